"""The one output rule of every command that writes, asked once before any work.

Each command lists its run's paths declaratively (`RunPaths`: the inputs it reads and the
outputs it writes, by flag); `refusal(run)` returns the one line refusing the first clash, or
None. Refused:
- an output that is, contains, or lies inside an input of the same run (a shard set, an
  adapter, weights, a mixture file, a template, eval files): writing there could replace or
  delete what the run reads;
- an output that is the working folder or any folder above it;
- two outputs of one run that overlap.
Except where the command's own layout puts one inside the other, listed in `run.inside`
({(inner flag, outer flag): where}): `pack --from-tokens OUT/tokens --output OUT` (the tokenized
set is OUT's own), and a `--profile-dir` that is (or is inside) the `--tensorboard` folder. A
path a run both reads and writes is listed once, as an output (the --checkpoint-dir a run
resumes from and writes to). A new output option is one more `Place` in its command's list
(train/run_config/outputs.py `run_outputs`, each app's `run_paths`, pipelines/options.py `run_paths`).

Paths are compared as places, not strings: locally after `~`, `.`/`..`, trailing slashes and
symlinks are resolved (os.path.realpath: a link to a parent is its parent); gs:// by bucket and
prefix, component by component (gs://b/ab is not inside gs://b/a). Input specs that are not
paths (tfds:NAME, hf:NAME of the Hub, `random`, an embedded tokenizer name) are left out by the
caller (`input_places` does it for input specs); a glob is represented by the folder before its
first wildcard.

One resolved path per output: a command turns each output path into `output_path(flag, path)`
(places.py's resolution, as the kernel resolves it) once, where it reads its options, and both
this rule and the writer use that string (a writer that normalised the path on its own,
os.path.abspath, wrote elsewhere than the rule judged: `--save-lora s/../SET` with
`s -> /elsewhere/x` was judged as /elsewhere/SET and written into ./SET). A line names an output
as the user spelled it, with "(resolves to REAL)" where links make it another place (`named`).
A path through a dangling link or a link loop names no place and is refused in one line.
No JAX, no Beam: `prepack pack` asks before it imports Beam, `prepack train` before any weight
loads.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

from prepack.storage.gcs import is_gcs
from prepack.storage.places import link_problem, resolved
from prepack.storage.patterns import has_wildcard, literal_head


Key = tuple[str, tuple[str, ...]]  # (root, components): "/" or "gs://BUCKET", then each folder


@dataclasses.dataclass(frozen=True)
class Place:
    """One path of a run, by the flag that names it (`--save-lora`, `--input`)."""

    flag: str
    path: str
    # False for an input pattern's folder: the run reads some files in it, so an output may lie
    # inside it (but not be it or contain it)
    whole: bool = True


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """What one run of a command reads and writes. `inside`: {(inner flag, outer flag): where}
    for the paths the command's layout puts inside an output: the inner input or output may be
    exactly at `where` under the outer output ("tokens": OUT/tokens), or with where == "" be the
    outer or lie anywhere inside it. An outer that lies inside its inner is still refused."""

    inputs: Sequence[Place]
    outputs: Sequence[Place]
    inside: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    def allows(self, inner: Place, inner_key: Key, outer: Place, outer_key: Key) -> bool:
        if (inner.flag, outer.flag) not in self.inside:
            return False
        where = tuple(p for p in self.inside[(inner.flag, outer.flag)].split("/") if p)
        return inner_key == (outer_key[0], outer_key[1] + where) if where else _within(inner_key, outer_key)


class OutputPathError(ValueError):
    """An output path that names no place a writer could use (a dangling link, a link loop): one line."""


# The spelling each resolved output was given in (the latest), for messages only: a line names the
# path as the user wrote it, and where links made it another place, that place too.
_GIVEN: dict[str, str] = {}


def named(path: str) -> str:
    """An output path for a message: as the user wrote it (`S`, `./out/`), with "(resolves to REAL)"
    where the place differs from what the spelling reads as (a link followed by `..`)."""
    given = _GIVEN.get(path)
    if given is None or given == path:
        return path
    lexical = os.path.abspath(os.path.expanduser(given))
    return given if lexical == path else f"{given} (resolves to {path})"


def output_path(flag: str, path: str, cwd: str | None = None) -> str:
    """The one string a command checks and writes an output at: `resolved(path)`, asked once where
    the command reads its options. Raises OutputPathError (one line naming the flag) for a path
    through a dangling link or a link loop, or one that names no place (location_problem: s3://,
    gs:///x), in the rule's own words."""
    from prepack.storage import location_problem

    if location_problem(path):
        raise OutputPathError(f"{flag} {location_problem(path)}")
    problem = link_problem(path, cwd)
    if problem:
        raise OutputPathError(f"{flag} {path}{problem}")
    real = resolved(path, cwd)
    _GIVEN[real] = path
    return real


def place_key(path: str, cwd: str | None = None) -> Key:
    """(root, components) naming the place `path` is: ("gs://BUCKET", prefix parts) on gs://,
    ("/", the real path's parts) locally, resolved against `cwd` (default: the working folder)."""
    if is_gcs(path):
        bucket, _, prefix = path[len("gs://"):].partition("/")
        return f"gs://{bucket}", tuple(p for p in prefix.split("/") if p)
    return "/", tuple(p for p in resolved(path, cwd).split(os.sep) if p)  # symlinks, `.`, `..`, trailing slashes


def shown(key: Key) -> str:
    """The place as a path again: /a/b, gs://bucket/a/b."""
    return key[0].rstrip("/") + "/" + "/".join(key[1]) if key[1] else key[0]


def _within(inner: Key, outer: Key) -> bool:
    """`inner` is `outer` or lies inside it (component by component)."""
    return inner[0] == outer[0] and inner[1][:len(outer[1])] == outer[1]


def input_places(flag: str, specs: Sequence[str | None]) -> list[Place]:
    """The places input specs read, for `RunPaths.inputs`: local paths and gs:// as they are,
    `hf:./folder` and `sp:FILE` by their path, a glob (`data/*.jsonl`, `DIR/`) by the folder
    before its first wildcard (whole=False). Specs that read no path of this run are left out:
    tfds:NAME, hf:NAME of the Hub, other schemes (refused as inputs in their own words), None."""
    from prepack.storage import location_problem, on_this_machine

    places = []
    for spec in specs:
        if not spec or spec.startswith("tfds:"):
            continue
        path = spec
        if spec.startswith(("hf:", "sp:")):
            path = spec[3:]
            if spec.startswith("hf:") and not on_this_machine(spec):
                continue
        elif not is_gcs(spec) and location_problem(spec):
            continue
        if path.endswith("/") and not path.endswith(":/"):
            path += "*"  # `DIR/` reads the files directly in DIR (prepack.storage.patterns.folder_pattern)
        if not has_wildcard(path):
            places.append(Place(flag, path))
            continue
        head = literal_head(path)
        places.append(Place(flag, head.rsplit("/", 1)[0] if "/" in head else ".", whole=False))
    return places


def refusal(run: RunPaths, cwd: str | None = None) -> str | None:
    """The one line refusing the first output that breaks the rule (module docstring), else None.
    A path that names no place (prepack.storage.location_problem) is refused first: it cannot be compared."""
    from prepack.storage import location_problem

    for p in (*run.outputs, *run.inputs):
        problem = location_problem(p.path)
        if problem:
            return f"{p.flag} {problem}"
    for o in run.outputs:  # a command passes `output_path`'s string (checked there); a library caller may not
        broken = link_problem(o.path, cwd)
        if broken:
            return f"{o.flag} {o.path}{broken}"
    here = place_key(".", cwd)
    outputs = [(o, place_key(o.path, cwd)) for o in run.outputs]
    inputs = [(i, place_key(i.path, cwd)) for i in run.inputs]
    for o, key in outputs:
        if _within(here, key):
            what = "the working folder" if key == here else "a folder above the working folder"
            name = named(o.path)
            real = "" if name == shown(key) or name.endswith(f"(resolves to {shown(key)})") else f" ({shown(key)})"
            return (f"{o.flag} {name} is {what}{real}; writing there could replace the files "
                    f"of this run and others: give {o.flag} a new folder of its own")
    for o, key in outputs:
        for i, in_key in inputs:
            if run.allows(i, in_key, o, key):
                continue
            if _within(key, in_key) and (i.whole or key == in_key) or _within(in_key, key):
                how = "is" if key == in_key else "lies inside" if _within(key, in_key) else "contains"
                return (f"{o.flag} {named(o.path)} {how} the input {i.flag} {i.path}; writing there could replace or delete "
                        f"what this run reads: give {o.flag} a path outside every input")
    for n, (a, a_key) in enumerate(outputs):
        for b, b_key in outputs[n + 1:]:
            if run.allows(a, a_key, b, b_key) or run.allows(b, b_key, a, a_key):
                continue
            if _within(a_key, b_key) or _within(b_key, a_key):
                how = "is" if a_key == b_key else "lies inside" if _within(a_key, b_key) else "contains"
                return (f"{a.flag} {named(a.path)} {how} {b.flag} {named(b.path)}; one output's writer could replace the other's "
                        "files: give each output its own path, neither inside the other")
    return None
