"""The layering the project promises.

1. Between packages (testkit/import_graph.py reads every import from the source,
   including imports inside functions): benchmarks/ and testkit/ on top, then
   apps/ and gcp/; train/ above loaders/; pipelines/ and loaders/ side by side,
   importing neither each other nor anything above; the core prepack/ at the
   bottom importing none of them. No module imports anything above it, and there
   is no circle: neither between modules nor between folders (a module at a
   package's top counts in that package's folder).
2. Third-party: the core imports neither Beam nor JAX, the pipeline never
   imports JAX (Dataflow workers install no JAX), and the loader never imports
   Beam. Each of these checks runs in a fresh interpreter so nothing else in the
   test session has loaded the modules first.
3. Inside packages: the pipeline's folders and the core's and train/'s rooms import
   downward only; each room of train/ imports only the rooms its README.md's one
   `May import (rooms of train/): ...` line lists.
"""

import re
import subprocess
import sys
import textwrap

import pytest
from testkit.import_graph import (LAYERS, ROOT, SCRIPT_FOLDERS, cycles, folder_graph, import_graph, module_folders,
                                  upward_imports)


def test_no_import_points_up_or_sideways():
    graph = import_graph()
    assert set(graph) >= {"apps.cli", "apps.preflight", "apps.report", "pipelines.launch.job", "loaders.shards", "prepack.packing.packer"}
    assert upward_imports(graph) == []


def test_no_import_cycle():
    graph = import_graph()
    assert {"benchmarks.bench_attention", "benchmarks.gemma3_step"} <= set(graph)
    assert cycles(graph) == []


def test_no_folder_imports_a_folder_that_imports_it():
    """pipelines/' loose modules and pipelines/inputs/, prepack/format/ and prepack/packing/:
    of two folders, at most one imports the other."""
    folders = module_folders()
    assert {"pipelines", "pipelines.inputs", "prepack.format", "prepack.packing", "benchmarks", "train", "train.objectives",
            "train.step"} <= set(folders.values())
    assert cycles(folder_graph(import_graph(), folders)) == []


def _tree(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return import_graph(tmp_path)


def test_the_layer_check_can_fail(tmp_path):
    """A lazy upward import in the core, a sideways one between pipelines and loaders, and a
    cycle of modules (in a package and among the benchmark scripts) are each caught, so the
    assertions above are not vacuous."""
    graph = _tree(tmp_path, {
        "prepack/__init__.py": "",
        "prepack/core.py": "def f():\n    from pipelines import job  # lazy, still counts\n",
        "pipelines/__init__.py": "",
        "pipelines/job.py": "from loaders.shards import open_shards\nimport prepack.core\n",
        "loaders/__init__.py": "",
        "loaders/shards.py": "import loaders.other\n",
        "loaders/other.py": "from loaders import shards\n",
        "benchmarks/bench_attention.py": "def f():\n    from benchmarks import gemma3_step\n",
        "benchmarks/gemma3_step.py": "from benchmarks.bench_attention import dense_attention\n",
        "apps/__init__.py": "", "gcp/__init__.py": "", "train/__init__.py": "",
    })
    assert upward_imports(graph) == ["pipelines.job -> loaders.shards", "prepack.core -> pipelines.job"]
    assert cycles(graph) == [["benchmarks.bench_attention", "benchmarks.gemma3_step"], ["loaders.other", "loaders.shards"],
                             ["pipelines.job", "prepack.core"]]


def test_the_folder_check_can_fail(tmp_path):
    """The two circles of folders this project had, without a cycle of modules: a loose module at
    pipelines/' top imports a reader that imports another loose module; format and packing
    import each other through different modules."""
    graph = _tree(tmp_path, {
        "pipelines/__init__.py": "", "pipelines/sources.py": "", "pipelines/inputs/__init__.py": "",
        "pipelines/preparer.py": "from pipelines.inputs import readers\n",
        "pipelines/inputs/readers.py": "from pipelines import sources\n",
        "prepack/__init__.py": "", "prepack/format/__init__.py": "", "prepack/packing/__init__.py": "",
        "prepack/format/rowformat.py": "", "prepack/packing/accounting.py": "",
        "prepack/format/recount.py": "from prepack.packing.accounting import Tally\n",
        "prepack/packing/mixture.py": "def f():\n    from prepack.format.rowformat import MAX_SOURCES\n",
    })
    assert cycles(graph) == []
    assert cycles(folder_graph(graph, module_folders(tmp_path))) == [["pipelines", "pipelines.inputs"],
                                                                     ["prepack.format", "prepack.packing"]]


def test_every_package_has_a_layer():
    top_level = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert top_level == set(LAYERS) - SCRIPT_FOLDERS


CASES = {
    "core": (
        "import prepack.format.rowformat, prepack.packing.packer, prepack.packing.stats, prepack.format.manifest, prepack.format.shardfile, "
        "prepack.text.formats, prepack.text.chat, prepack.text.tokenizer, prepack.text.gemma3_gguf; "
        "from prepack.text.tokenizer import load_tokenizer; load_tokenizer('gemma3').encode('hi')",
        ("apache_beam", "jax", "grain"),
    ),
    "pipeline": (
        "import pipelines.launch.cli, pipelines.launch.job, pipelines.stages.read, pipelines.stages.prepare, pipelines.stages.fit, pipelines.stages.route, "
        "pipelines.stages.write, pipelines.launch.errors, pipelines.launch.job_stats, pipelines.launch.existing_sets, pipelines.launch.prepare_job, pipelines.launch.graph, pipelines.launch.verify, pipelines.launch.manifest_compose, "
        "pipelines.inputs.sources, pipelines.inputs.readers, pipelines.planning",
        ("jax", "flax", "tunix", "grain"),
    ),
    "loader": (
        "import loaders, loaders.shards, loaders.dataset, loaders.mask, loaders.checkpoint",
        ("apache_beam",),
    ),
    "cli": ("import apps.cli, apps.inspect", ("apache_beam", "jax")),
}


@pytest.mark.parametrize("side", sorted(CASES))
def test_side_does_not_import_the_other(side):
    code, forbidden = CASES[side]
    check = f"import sys; {code}; print(sorted(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{side} imported {out.stdout.strip()}"


def test_the_check_can_fail():
    """A module that does import jax is caught, so the assertions above are not vacuous."""
    out = subprocess.run([sys.executable, "-c", "import sys, jax.numpy; print(sorted(m for m in ('jax',) if m in sys.modules))"],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "['jax']"


def _storage_breaks(root=ROOT) -> list[str]:
    """prepack/storage/ is the one storage interface: nothing else imports google-cloud-storage,
    neither the output layer nor the rest of the core asks is_gcs (they go through storage_for,
    which answers it once), and nothing opens a file through Beam's FileSystems or GcsIO: the job's
    streamed files go through the interface too."""
    breaks = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("prepack/storage/", "tests/", "testkit/", ".")) or "/." in rel:
            continue
        text = path.read_text()
        if "google.cloud" in text.replace("google_cloud_options", "") or "google.api_core" in text:
            breaks.append(f"{rel} uses the GCS client")
        if rel.startswith(("pipelines/output/", "prepack/")) and "is_gcs(" in text:
            breaks.append(f"{rel} asks is_gcs")
        if "apache_beam.io.filesystem" in text or "apache_beam.io.gcp" in text:
            breaks.append(f"{rel} uses Beam's FileSystems")
    return breaks


def test_stages_do_not_reach_into_the_output_layer():
    """Stages write only under staging paths named by prepack.format.layout; publishing (and its lock
    and fencing) is the launcher's, through pipelines.output."""
    graph = import_graph()
    stages = sorted(m for m in graph if m.startswith("pipelines.stages."))
    assert [f"{m} -> {d}" for m in stages for d in graph[m] if d.startswith("pipelines.output")] == []


def test_one_storage_interface(tmp_path):
    assert (ROOT / "prepack" / "storage" / "gcs.py").read_text().count("from google.cloud import storage") == 1
    assert _storage_breaks() == []
    # The check can fail: the output layer asking is_gcs, a loader with its own GCS client, a stage
    # or a pipeline module of its own opening files through FileSystems.
    for name, text in {"pipelines/output/commit.py": "if is_gcs(path):\n    pass\n",
                       "pipelines/stages/write.py": "from apache_beam.io.filesystems import FileSystems\n",
                       "pipelines/files.py": "from apache_beam.io.filesystems import FileSystems\n",
                       "loaders/shards.py": "from google.cloud import storage\n",
                       "prepack/storage/gcs.py": "from google.cloud import storage\nis_gcs(p)\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _storage_breaks(tmp_path) == ["loaders/shards.py uses the GCS client", "pipelines/files.py uses Beam's FileSystems",
                                         "pipelines/output/commit.py asks is_gcs", "pipelines/stages/write.py uses Beam's FileSystems"]


# pipelines/' folders, bottom first (its loose top modules count in the folder "pipelines"): faults/
# (how the job fails: failures, failpoints); wire/ (what travels between steps); inputs/ (input
# specs to read tasks, and reading them) and output/ (publishing) side by side; the loose modules
# the launcher and the stages share (configs, options, preparer, planning); stages/ (the Beam
# graph's stages, run on workers); launch/ (the command and the launcher). A folder imports only
# the folders below it.
PIPELINE_FOLDERS = {"pipelines.faults": 0, "pipelines.wire": 1, "pipelines.inputs": 2, "pipelines.output": 2,
                    "pipelines": 3, "pipelines.stages": 4, "pipelines.launch": 5}


def _inner_layer_breaks(graph: dict[str, set[str]], folders: dict[str, str]) -> list[str]:
    ranked = {m: PIPELINE_FOLDERS[f] for m, f in folders.items() if f in PIPELINE_FOLDERS}
    return sorted(f"{m} -> {d}" for m in graph if m in ranked for d in graph[m]
                  if d in ranked and folders[d] != folders[m] and ranked[d] >= ranked[m])


def test_pipelines_folders_import_downward_only(tmp_path):
    folders = module_folders()
    assert {f for f in folders.values() if f.split(".")[0] == "pipelines"} == set(PIPELINE_FOLDERS)
    assert _inner_layer_breaks(import_graph(), folders) == []
    # The check can fail: a stage reaching up into the launcher, the output layer into a stage, a
    # reader into a loose top module, faults/ into the configs, inputs/ and output/ into each other.
    graph = _tree(tmp_path, {
        "pipelines/__init__.py": "", "pipelines/stages/__init__.py": "", "pipelines/launch/__init__.py": "",
        "pipelines/output/__init__.py": "", "pipelines/sources.py": "", "pipelines/configs.py": "from pipelines.output import lock\n",
        "pipelines/stages/fit.py": "from pipelines.launch import job\n",
        "pipelines/launch/job.py": "from pipelines.stages import fit\n",
        "pipelines/output/commit.py": "import pipelines.stages.fit\n",
        "pipelines/output/lock.py": "from pipelines.inputs.readers import ReadTask\n",
        "pipelines/wire/__init__.py": "", "pipelines/wire/columns.py": "from pipelines.output import commit\n",
        "pipelines/inputs/__init__.py": "",
        "pipelines/inputs/readers.py": "from pipelines.stages import fit\nfrom pipelines import sources\nfrom pipelines.wire import columns\n",
        "pipelines/faults/__init__.py": "", "pipelines/faults/failures.py": "from pipelines import configs\n",
        "prepack/__init__.py": "", "loaders/__init__.py": "", "apps/__init__.py": "", "gcp/__init__.py": "", "train/__init__.py": "",
    })
    assert _inner_layer_breaks(graph, module_folders(tmp_path)) == [
        "pipelines.faults.failures -> pipelines.configs",
        "pipelines.inputs.readers -> pipelines.sources",
        "pipelines.inputs.readers -> pipelines.stages.fit",
        "pipelines.output.commit -> pipelines.stages.fit",
        "pipelines.output.lock -> pipelines.inputs.readers",
        "pipelines.stages.fit -> pipelines.launch.job",
        "pipelines.wire.columns -> pipelines.output.commit"]


# The core's rooms, bottom first, one above the other: hostile_input (reading what others can
# write: untrusted, strict_yaml; it imports nothing of the project), text (what an example says),
# packing (how examples fill rows; a mixture file is parsed with hostile_input's readers), format
# (how rows and packing's accounting go to disk: the tokenized set's manifest checks packing's
# Tally, the recount judges a set by packing's figures), storage (where files live: it joins paths
# by the layout and reports a damaged file as the format's ManifestError). A room imports only the
# rooms below it; prepack's top-level modules (cli_help, overwrite) sit above every room.
CORE_ROOMS = {"hostile_input": 0, "text": 1, "packing": 2, "format": 3, "storage": 4}


def _room_rank(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "prepack" or len(parts) < 2 or parts[1] == "sample_data":
        return None
    return CORE_ROOMS.get(parts[1], max(CORE_ROOMS.values()) + 1)


def _room_breaks(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m in graph for d in graph[m]
                  if _room_rank(m) is not None and _room_rank(d) is not None and _room_rank(d) > _room_rank(m))


def test_core_rooms_import_downward_only(tmp_path):
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if m.startswith("prepack.") and m.count(".") >= 2} >= set(CORE_ROOMS)
    assert _room_breaks(graph) == []
    # The check can fail: text reaching up into packing, packing into format, format into storage,
    # hostile_input into text, a room into a top-level module.
    graph = _tree(tmp_path, {
        "prepack/__init__.py": "", "prepack/overwrite.py": "",
        "prepack/hostile_input/__init__.py": "", "prepack/hostile_input/untrusted.py": "from prepack.text import templates\n",
        "prepack/text/__init__.py": "", "prepack/text/templates.py": "from prepack.packing import packer\nfrom prepack.hostile_input import untrusted\n",
        "prepack/packing/__init__.py": "", "prepack/packing/packer.py": "from prepack.text import templates\nfrom prepack.format import manifest\n",
        "prepack/format/__init__.py": "", "prepack/format/manifest.py": "import prepack.storage.gcs\nfrom prepack import overwrite\nfrom prepack.packing import packer\n",
        "prepack/storage/__init__.py": "", "prepack/storage/gcs.py": "from prepack.format import manifest\n",
        "pipelines/__init__.py": "", "loaders/__init__.py": "", "apps/__init__.py": "", "gcp/__init__.py": "", "train/__init__.py": "",
    })
    assert _room_breaks(graph) == ["prepack.format.manifest -> prepack.overwrite", "prepack.format.manifest -> prepack.storage.gcs",
                                   "prepack.hostile_input.untrusted -> prepack.text.templates",
                                   "prepack.packing.packer -> prepack.format.manifest", "prepack.text.templates -> prepack.packing.packer"]



# train/'s rooms, bottom first (train/README.md, "Modules"; each room's README.md): families (what
# differs between model families) and compilation (the compile cache, the preload, the remat verdicts)
# side by side at the bottom; run_config (what a run is asked to do; the cache folder is one of its
# outputs) and attention_kernels; step (the step and its loss); model and objectives; measurement,
# checkpointing, adapter_files and verification; generation. A room imports only rooms of a lower rank;
# the modules at train/'s top (the run: cli, trainer, run_setup, ...) sit above every room, so no room
# imports them.
TRAIN_ROOMS = {"families": 0, "compilation": 0, "run_config": 1, "attention_kernels": 1, "step": 2, "model": 3,
               "objectives": 3, "measurement": 4, "checkpointing": 4, "adapter_files": 4, "verification": 4,
               "generation": 5}


def _train_room_rank(module: str, folders: dict[str, str]) -> int | None:
    folder = folders.get(module, "")
    if folder.split(".")[0] != "train":
        return None
    return TRAIN_ROOMS.get(folder.partition(".")[2], max(TRAIN_ROOMS.values()) + 1)  # train/'s top: above every room


def _train_room_breaks(graph: dict[str, set[str]], folders: dict[str, str]) -> list[str]:
    breaks = []
    for m in graph:
        rank = _train_room_rank(m, folders)
        for d in graph[m]:
            other = _train_room_rank(d, folders)
            if rank is not None and other is not None and folders[d] != folders[m] and other >= rank:
                breaks.append(f"{m} -> {d}")
    return sorted(breaks)


def test_train_rooms_import_downward_only(tmp_path):
    folders = module_folders()
    assert {f.partition(".")[2] for f in folders.values() if f.startswith("train.")} == set(TRAIN_ROOMS)
    assert _train_room_breaks(import_graph(), folders) == []
    # The check can fail: a room reaching up to train/'s top, the step into measurement, two rooms of
    # one rank into each other.
    graph = _tree(tmp_path, {
        "train/__init__.py": "", "train/cli.py": "", "train/step/__init__.py": "", "train/measurement/__init__.py": "",
        "train/model/__init__.py": "", "train/objectives/__init__.py": "",
        "train/step/loss.py": "from train import cli\nfrom train.measurement import metrics\n",
        "train/measurement/metrics.py": "", "train/model/models.py": "from train.objectives import sft\n",
        "train/objectives/sft.py": "", "prepack/__init__.py": "", "loaders/__init__.py": "",
        "pipelines/__init__.py": "", "apps/__init__.py": "", "gcp/__init__.py": "",
    })
    assert _train_room_breaks(graph, module_folders(tmp_path)) == ["train.model.models -> train.objectives.sft",
                                                                   "train.step.loss -> train.cli",
                                                                   "train.step.loss -> train.measurement.metrics"]


# Each room's README.md states the rooms of train/ it may import in one line, one form:
#   May import (rooms of train/): [`run_config/`](../run_config/README.md), [`step/`](../step/README.md).
# or `May import (rooms of train/): none.`; train/README.md's table of rooms says the same in its last column.
ROOM_LIST_LINE = re.compile(r"^May import \(rooms of train/\): (.*)$", re.M)
ROOM_LINK = re.compile(r"\[`(\w+)/`\]\(\.\./\1/README\.md\)")
ROOMS_TABLE_ROW = re.compile(r"^\| \[`(\w+)/`\]\(\1/README\.md\) \|.*\| ([^|]*) \|$", re.M)


def readme_rooms(text: str, where: str) -> set[str]:
    """The rooms a room's README says it may import, from its one `May import (rooms of train/):` line."""
    lines = ROOM_LIST_LINE.findall(text)
    if len(lines) != 1:
        raise AssertionError(f"{where}: {len(lines)} lines 'May import (rooms of train/): ...' (one expected)")
    listed = lines[0].removesuffix(".")
    if listed == "none":
        return set()
    rooms = set()
    for item in listed.split(", "):
        link = ROOM_LINK.fullmatch(item)
        if link is None:
            raise AssertionError(f"{where}: {item!r} in the 'May import' line is not a room's link [`room/`](../room/README.md)")
        rooms.add(link[1])
    return rooms


def _train_readme_breaks(graph: dict[str, set[str]], folders: dict[str, str], root=ROOT) -> list[str]:
    """Every import from a room of train/ into another folder of train/ (a room, or train/'s top) that the
    importing room's README does not list."""
    allowed = {}
    for folder in sorted(set(folders.values())):
        if folder.startswith("train."):
            room = folder.partition(".")[2]
            allowed[folder] = readme_rooms((root / "train" / room / "README.md").read_text(), f"train/{room}/README.md")
    breaks = []
    for m in sorted(graph):
        if folders.get(m) not in allowed:
            continue
        for d in sorted(graph[m]):
            target = folders.get(d, "")
            if target.split(".")[0] == "train" and target != folders[m] and target.partition(".")[2] not in allowed[folders[m]]:
                where = f"{target.partition('.')[2]}/" if "." in target else "train/'s top"
                breaks.append(f"{m} -> {d}: train/{folders[m].partition('.')[2]}/README.md does not list {where}")
    return breaks


def test_train_rooms_import_only_the_rooms_their_readme_lists():
    folders = module_folders()
    assert _train_readme_breaks(import_graph(), folders) == []


def test_the_rooms_table_says_what_each_readme_says():
    """train/README.md's table of rooms and each room's own line name the same rooms."""
    table = {room: set() if last == "(none)" else set(re.findall(r"`(\w+)/`", last))
             for room, last in ROOMS_TABLE_ROW.findall((ROOT / "train" / "README.md").read_text())}
    assert set(table) == set(TRAIN_ROOMS)
    assert {room: readme_rooms((ROOT / "train" / room / "README.md").read_text(), room) for room in TRAIN_ROOMS} == table


def test_the_readme_check_can_fail(tmp_path):
    """adapter_files/ whose README lists model/ only, importing step/ and train/'s top, is caught; so are a
    README without the line and a line whose item is not a room's link."""
    files = {
        "train/__init__.py": "", "train/cli.py": "", "train/step/__init__.py": "", "train/step/loss.py": "",
        "train/model/__init__.py": "", "train/model/models.py": "from train.step import loss\n",
        "train/adapter_files/__init__.py": "",
        "train/adapter_files/peft_export.py": "from train.model import models\nfrom train.step import loss\n"
                                              "def f():\n    from train import cli\n",
        "prepack/__init__.py": "", "loaders/__init__.py": "", "pipelines/__init__.py": "", "apps/__init__.py": "",
        "gcp/__init__.py": "",
    }
    graph = _tree(tmp_path, files)
    for room, line in {"adapter_files": "[`model/`](../model/README.md).", "model": "[`step/`](../step/README.md).",
                       "step": "none."}.items():
        (tmp_path / "train" / room / "README.md").write_text(f"# {room}\n\nMay import (rooms of train/): {line}\n")
    folders = module_folders(tmp_path)
    assert _train_readme_breaks(graph, folders, tmp_path) == [
        "train.adapter_files.peft_export -> train.cli: train/adapter_files/README.md does not list train/'s top",
        "train.adapter_files.peft_export -> train.step.loss: train/adapter_files/README.md does not list step/"]
    (tmp_path / "train" / "model" / "README.md").write_text("May import: [`step/`](../step/README.md).\n")
    with pytest.raises(AssertionError, match=r"train/model/README.md: 0 lines 'May import \(rooms of train/\)"):
        _train_readme_breaks(graph, folders, tmp_path)
    (tmp_path / "train" / "model" / "README.md").write_text("May import (rooms of train/): `step/`.\n")
    with pytest.raises(AssertionError, match="'`step/`' in the 'May import' line is not a room's link"):
        _train_readme_breaks(graph, folders, tmp_path)


def test_contracts_lists_every_module():
    """docs/CONTRACTS.md names every module of the project with its purpose."""
    listed = (ROOT / "docs" / "CONTRACTS.md").read_text()
    missing = sorted(p.relative_to(ROOT).as_posix() for p in import_graph_paths() if f"`{p.relative_to(ROOT).as_posix()}`:" not in listed)
    assert missing == []


def test_imports_page_is_current():
    """docs/imports.md is the picture of today's source, not of an older one."""
    from testkit.import_graph import render_markdown

    page = (ROOT / "docs" / "imports.md").read_text()
    assert page == render_markdown(import_graph(), module_folders()), "redraw it: python -m testkit.import_graph > docs/imports.md"


def import_graph_paths():
    from testkit.import_graph import project_modules

    return sorted(project_modules(packages=set(LAYERS) - SCRIPT_FOLDERS).values())


MAX_FUNCTION_LINES = 80


def long_functions(root) -> list[str]:
    """Functions (methods and nested ones included) over MAX_FUNCTION_LINES lines, outside tests/."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in {".venv", "tests", "build"} or any(p.startswith(".") for p in rel.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_80_lines_outside_tests():
    import pathlib

    assert long_functions(pathlib.Path(ROOT)) == []


def test_the_length_check_can_fail(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_long.py").write_text(f"def g():\n{body}\n")  # tests may be long
    assert long_functions(tmp_path) == [f"pkg/long.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
