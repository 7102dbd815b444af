"""How a command that writes a folder of its own files replaces them: only its own, nothing else.

`write_own_files(target, files, owns)` writes the files whole beside the folder first (a staging
folder next to it, so a failed write leaves the old files as they were), then swaps them into the
folder one by one, and removes only files that `owns(name)` says are of the kind the command
writes (a stale shard of an earlier merged export, a tokenizer.model beside a new tokenizer.json)
that this run did not write. Locally the swap is all or nothing: a rename that fails puts the old
files back. Every other file or folder in the target stays: a user's notes, a
shard set, the run's own metrics. Nothing here removes a folder.

Used by `prepack train --save-lora` (a PEFT folder), `prepack export --merge` and `prepack
tokenizer-folder`. Whether an existing target may be written at all (--overwrite) is the
command's decision, taken before any work; where it may lie is prepack/storage/output_rule.py's.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Mapping

from prepack.storage import places
from prepack.storage.gcs import is_gcs


class OwnFilesError(ValueError):
    """A staged file the command does not know as its own; nothing was replaced."""


def write_own_files(target: str, files: Mapping[str, bytes] | Callable[[str], None], owns: Callable[[str], bool],
                    content_type: str = "application/octet-stream") -> list[str]:
    """Writes `files` (name -> bytes, or a function that writes them into the folder it is given)
    into the folder `target`; returns the names written. A written name `owns` refuses raises
    OwnFilesError before anything in `target` changes."""
    if is_gcs(target):
        if callable(files):
            raise OwnFilesError(f"{target}: this writer writes local folders only")
        return _write_gcs(target, files, owns, content_type)
    target = places.resolved(target)  # where the output rule judged it (`s/..` through a link: not abspath's)
    beside = os.path.dirname(target)
    os.makedirs(beside, exist_ok=True)
    # Staged beside, not inside: the staging folder never shows in the target, and a rename within
    # one file system is atomic per file.
    with tempfile.TemporaryDirectory(dir=beside, prefix=f".{os.path.basename(target)}.staging-") as staging:
        if callable(files):
            files(staging)
        else:
            for name, data in files.items():
                with open(os.path.join(staging, _plain_name(name, target)), "wb") as f:
                    f.write(data)
        written = sorted(os.listdir(staging))
        unknown = [n for n in written if not owns(n) or not os.path.isfile(os.path.join(staging, n))]
        if unknown:
            raise OwnFilesError(f"{target}: the writer made {', '.join(unknown)}, which this command does not know as "
                                "its own; nothing was replaced")
        created = not os.path.lexists(target)
        os.makedirs(target, exist_ok=True)
        _swap(target, staging, written, owns, created)
    return written


def _swap(target: str, staging: str, written: list[str], owns: Callable[[str], bool], created: bool) -> None:
    """All or nothing: the old own files (replaced or stale) are moved aside into the staging folder
    first, then the new ones in; should any rename fail, the new ones come out and the old ones go
    back, so the folder never holds a mix of two writes (a new adapter beside an old config)."""
    aside = os.path.join(staging, ".previous")
    os.mkdir(aside)
    old = [n for n in sorted(os.listdir(target))
           if owns(n) and os.path.isfile(os.path.join(target, n)) and not os.path.islink(os.path.join(target, n))]
    moved: list[str] = []
    placed: list[str] = []
    try:
        for name in old:
            os.replace(os.path.join(target, name), os.path.join(aside, name))
            moved.append(name)
        for name in written:
            os.replace(os.path.join(staging, name), os.path.join(target, name))
            placed.append(name)
    except BaseException:
        for name in placed:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(target, name))
        for name in moved:
            with contextlib.suppress(OSError):
                os.replace(os.path.join(aside, name), os.path.join(target, name))
        if created:  # a folder this run made: it leaves nothing of itself behind
            with contextlib.suppress(OSError):
                os.rmdir(target)
        raise


def _plain_name(name: str, target: str) -> str:
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise OwnFilesError(f"{target}: {name!r} is not a plain file name")
    return name


def _write_gcs(target: str, files: Mapping[str, bytes], owns: Callable[[str], bool], content_type: str) -> list[str]:
    """On gs:// each object is replaced whole; the config-like .json files last, so a reader that
    finds the config finds the weights it names. Stale objects of the command's kind directly in
    the prefix are deleted after."""
    from prepack.storage import join, storage_for

    store = storage_for(target)
    unknown = [n for n in files if not owns(_plain_name(n, target))]
    if unknown:
        raise OwnFilesError(f"{target}: {', '.join(sorted(unknown))} is not a file this command writes; nothing was replaced")
    names = sorted(files, key=lambda n: (n.endswith(".json"), n))
    for name in names:
        store.replace(join(target, name), files[name], content_type=content_type)
    prefix = target.rstrip("/") + "/"
    stale = [p for p in store.list_files(target)
             if "/" not in p[len(prefix):] and p[len(prefix):] not in files and owns(p[len(prefix):])]
    store.delete(stale)
    return names
