"""The README's code runs as written, so it cannot drift from the code."""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, synthetic_row

REPO = Path(__file__).resolve().parent.parent
SETTINGS = re.compile(r'^SHARDS, BATCH_SIZE, STEPS, CKPT = "[^"]+", \d+, \d+, "[^"]+"$')
VOCAB, MAX_LENGTH, ROWS, BATCH = 128, 32, 12, 2


def readme_block(heading: str) -> str:
    """The first ```python block under `heading` in README.md."""
    text = (REPO / "README.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_own_trainer(settings: str, block: str) -> dict:
    """Runs the README block with the test's settings line and a fresh tiny LoRA model as `lora_model`."""
    from train.model import models

    built = models.build_model("tiny-qwen3", vocab_size=VOCAB, seed=0)
    scope = {"lora_model": models.apply_lora(built.model, built.spec, rank=4)}
    first, rest = block.split("\n", 1)
    assert SETTINGS.match(first), f"the block must start with its settings line, got {first!r}"
    exec(compile(settings + "\n" + rest, "README.md", "exec"), scope)  # noqa: S102
    return scope


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_own_tunix_trainer_section_trains_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    build_shard_set("OUT/L32", rows=[synthetic_row(r, MAX_LENGTH, rng, vocab_size=VOCAB) for r in range(ROWS)],
                    tokenizer={**TEST_TOKENIZER, "vocab_size": VOCAB})
    block = readme_block("## Your own Tunix trainer")

    first = run_own_trainer(f'SHARDS, BATCH_SIZE, STEPS, CKPT = "OUT/L32", {BATCH}, 2, "ckpt"', block)
    assert first["trainer"].train_steps == 2
    lora_b = [v for p, v in nnx.iter_graph(first["lora_model"]) if isinstance(v, nnx.LoRAParam) and "lora_b" in str(p[-1])]
    assert lora_b and any(float(np.abs(np.asarray(v[...])).max()) > 0 for v in lora_b)  # B starts at zero: it trained

    # A second process-equivalent run: Tunix restores step 2, the loader seeks to batch 3.
    from train.checkpointing import resume

    streams = []

    class Recorded(resume.ResumableStream):
        def __init__(self, iterator, **kwargs):
            streams.append(kwargs)
            super().__init__(iterator, **kwargs)

    monkeypatch.setattr(resume, "ResumableStream", Recorded)
    second = run_own_trainer(f'SHARDS, BATCH_SIZE, STEPS, CKPT = "OUT/L32", {BATCH}, 4, "ckpt"', block)
    assert second["trainer"].train_steps == 4
    assert streams == [{"consumed": 2, "placeholders": 2}]  # resumed by seeking, not by re-reading

    import loaders
    from train.checkpointing.checkpoints import CheckpointDir

    fresh = iter(loaders.make_dataset("OUT/L32", batch_size=BATCH, seed=0))
    for _ in range(4):
        next(fresh)
    ckpt = CheckpointDir("ckpt")
    assert ckpt.load_data_state(4) == json.loads(json.dumps(fresh.get_state()))  # saved with Tunix's step 4
    assert ckpt.load_data_state(2) is not None and sorted(ckpt._read_data()["states"]) == ["2", "4"]


# ----------------------------------------------------------------------------- facts the README states

README = (REPO / "README.md").read_text()
OUTPUT_OPTIONS = ("--output", "--metrics-out", "--save-lora", "--checkpoint-dir", "--tensorboard", "--profile-dir")


def walkthrough_outputs(text: str) -> set[str]:
    """Every path the README's bash blocks (and its own-trainer block's CKPT) write in the
    repository root, as an anchored .gitignore entry: folders end in /, generate --score adds
    FILE.score.json."""
    written: set[str] = set()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("#", 1)[0]
            for option, path in re.findall(r"(" + "|".join(OUTPUT_OPTIONS) + r")[ =](\S+)", command):
                if path.startswith(("/", "gs://", "$")):
                    continue
                is_file = os.path.splitext(path)[1] in (".jsonl", ".json", ".html", ".md")
                written.add(f"/{path}" if is_file else f"/{path}/")
                if option == "--output" and "--score" in command.split():
                    written.add(f"/{os.path.splitext(path)[0]}.score.json")
    written.update(f"/{ckpt}/" for ckpt in re.findall(r'^SHARDS, BATCH_SIZE, STEPS, CKPT = .*"([^"]+)"$', text, re.M))
    return written


def test_gitignore_covers_exactly_what_the_walkthrough_writes():
    """.gitignore missed 17 of the walkthrough's outputs and named an obsolete lora.safetensors."""
    text = (REPO / ".gitignore").read_text()
    lines = text.split("# What the README's walkthrough writes", 1)[1].splitlines()
    entries = itertools.dropwhile(lambda line: line.startswith("#"), lines[1:])  # the section's comment
    listed = set(itertools.takewhile(lambda line: line and not line.startswith("#"), entries))
    assert listed == walkthrough_outputs(README)
    assert all(entry.startswith("/") for entry in listed)  # anchored: prepack/sample_data/*.jsonl stays tracked


def test_the_cpu_loss_chunk_is_the_configs_default():
    from train.run_config.config import TrainConfig

    stated = re.search(r"the loss computes it ([\d,]+) tokens at a time,\s+`--loss-chunk-tokens`", README)
    assert stated and int(stated[1].replace(",", "")) == TrainConfig.loss_chunk_tokens
    assert f"`--loss-chunk-tokens {TrainConfig.loss_chunk_tokens}`" in README


def test_the_formats_list_names_every_format():
    from prepack.text.formats import template_names

    listed = README.split("\nFormats ([docs/formats.md]", 1)[1].split("Inputs:", 1)[0]
    assert [name for name in template_names() if f"`{name}`" not in listed] == []


def test_tiny_is_said_to_be_tiny_gemma3(capsys):
    from train import cli as train_cli
    from train.model.models import MODELS

    assert MODELS["tiny"].make_config is MODELS["tiny-gemma3"].make_config
    assert "`--model tiny`\nis `tiny-gemma3` under a shorter name: the same model" in README
    help_text = re.sub(r"-\s+", "-", " ".join(train_cli.build_parser().format_help().split()))  # lines break at hyphens
    assert "tiny is tiny-gemma3 under a shorter name, the same model" in help_text


def test_the_exit_codes_table_is_the_rule_in_cli_help():
    from prepack.cli_help import EXIT_FAILED, EXIT_OK, EXIT_REFUSED
    from train.measurement.divergence import EXIT_DIVERGED

    table = README.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    codes = [int(code) for code in re.findall(r"^\| (\d+) \|", table, re.M)]
    assert codes == [EXIT_OK, EXIT_FAILED, EXIT_REFUSED, EXIT_DIVERGED, 130]
