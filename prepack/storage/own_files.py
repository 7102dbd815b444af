"""How a command that writes a folder of its own files replaces them: only its own, nothing else.

`write_own_files(target, files, owns)` writes the files whole beside the folder first (a staging
folder next to it, so a failed write leaves the old files as they were), then swaps them into the
folder one by one, and removes only files that `owns(name)` says are of the kind the command
writes (a stale shard of an earlier merged export, a tokenizer.model beside a new tokenizer.json)
that this run did not write. Locally the swap is all or nothing: a rename that fails puts the old
files back. Every other file or folder in the target stays: a user's notes, a
shard set, the run's own metrics. Nothing here removes a folder but its own staging folders.

A run killed during the swap (SIGKILL, out of memory, power) cannot put the old files back, so
before the first old file moves, a journal is written in the staging folder (`.swap.json`,
made durable after every staged file is): the new files and the old ones they replace. The next
write to that target (`recover`) finds the killed run's staging folder beside it and finishes
the swap (the old files still in the folder aside, the new ones still staged in: the folder
then holds the new set whole), or, with no journal, the swap had not begun and the folder holds
the old set whole: the staging folder is removed. One line on stderr says which. Only a staging
folder of this module's name for that target (`.NAME.staging-XXXXXXXX`, the current user's, no
live writer holding its lock) whose journal reads as one (plain names of files the command
owns, known fields, a size cap: it is read as a stranger's) is touched; anything else is left.

Used by `prepack train --save-lora` (a PEFT folder), `prepack export --merge` and `prepack
tokenizer-folder`. Whether an existing target may be written at all (--overwrite) is the
command's decision, taken before any work; where it may lie is prepack/storage/output_rule.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping

from prepack.storage import failpoints, places
from prepack.storage.gcs import is_gcs


class OwnFilesError(ValueError):
    """A staged file the command does not know as its own; nothing was replaced."""


STAGING_INFIX = ".staging-"
JOURNAL = ".swap.json"
PREVIOUS = ".previous"
JOURNAL_FORMAT = "prepack-own-files-swap/1"
MAX_JOURNAL_BYTES = 1 << 16  # a journal names a few files; anything larger is not one
MAX_JOURNAL_NAMES = 1000
_TEMP_NAME = r"[a-z0-9_]{8}"  # tempfile's random part of a TemporaryDirectory's name


def write_own_files(target: str, files: Mapping[str, bytes] | Callable[[str], None], owns: Callable[[str], bool],
                    content_type: str = "application/octet-stream", say: Callable[[str], None] | None = None) -> list[str]:
    """Writes `files` (name -> bytes, or a function that writes them into the folder it is given)
    into the folder `target`; returns the names written. A written name `owns` refuses raises
    OwnFilesError before anything in `target` changes. A killed earlier write to `target` is
    finished or cleared first (`recover`; its one line goes to `say`, default stderr)."""
    if is_gcs(target):
        if callable(files):
            raise OwnFilesError(f"{target}: this writer writes local folders only")
        return _write_gcs(target, files, owns, content_type)
    target = places.resolved(target)  # where the output rule judged it (`s/..` through a link: not abspath's)
    beside = os.path.dirname(target)
    os.makedirs(beside, exist_ok=True)
    failpoints.configured()  # a PREPACK_FAILPOINTS that cannot be read fails here, before anything changes
    recover(target, owns, say)
    # Staged beside, not inside: the staging folder never shows in the target, and a rename within
    # one file system is atomic per file.
    staging = tempfile.mkdtemp(dir=beside, prefix=_staging_prefix(target))
    with _held(staging):
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
        failpoints.hit("own_files_staged")
        created = not os.path.lexists(target)
        os.makedirs(target, exist_ok=True)
        _swap(target, staging, written, owns, created)
    return written


def _staging_prefix(target: str) -> str:
    return f".{os.path.basename(target)}{STAGING_INFIX}"


@contextlib.contextmanager
def _held(staging: str) -> Iterator[None]:
    """The staging folder, locked (an OS lock) while its writer lives and removed when it is
    done: `recover` in another process leaves a folder whose lock is held (a live write, not a
    killed one). A killed process's locks go with it."""
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):  # a file system without locks: the write goes on unguarded
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(fd)


def _swap(target: str, staging: str, written: list[str], owns: Callable[[str], bool], created: bool) -> None:
    """All or nothing: the old own files (replaced or stale) are moved aside into the staging folder
    first, then the new ones in; should any rename fail, the new ones come out and the old ones go
    back, so the folder never holds a mix of two writes (a new adapter beside an old config). The
    journal, durable before the first move, lets a later run finish a swap this process could not."""
    aside = os.path.join(staging, PREVIOUS)
    os.mkdir(aside)
    old = [n for n in sorted(os.listdir(target))
           if owns(n) and os.path.isfile(os.path.join(target, n)) and not os.path.islink(os.path.join(target, n))]
    moved: list[str] = []
    placed: list[str] = []
    try:
        _write_journal(staging, written, old)
        failpoints.hit("own_files_journal")
        for name in old:
            os.replace(os.path.join(target, name), os.path.join(aside, name))
            moved.append(name)
            failpoints.hit("own_files_aside", str(len(moved)))
        for name in written:
            os.replace(os.path.join(staging, name), os.path.join(target, name))
            placed.append(name)
            failpoints.hit("own_files_placed", str(len(placed)))
    except BaseException:
        # Undone in the journal's terms (the new files back to the staging folder, the old ones
        # back in): a kill midway is still finished forward by `recover`.
        for name in placed:
            with contextlib.suppress(OSError):
                os.replace(os.path.join(target, name), os.path.join(staging, name))
        for name in moved:
            with contextlib.suppress(OSError):
                os.replace(os.path.join(aside, name), os.path.join(target, name))
        if created:  # a folder this run made: it leaves nothing of itself behind
            with contextlib.suppress(OSError):
                os.rmdir(target)
        raise


def _write_journal(staging: str, new: list[str], old: list[str]) -> None:
    """The journal, whole and on disk (after every staged file is), before anything in the target moves."""
    for name in new:
        _fsync_path(os.path.join(staging, name), os.O_RDONLY)
    tmp = os.path.join(staging, JOURNAL + ".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps({"format": JOURNAL_FORMAT, "new": new, "old": old}).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(staging, JOURNAL))
    _fsync_path(staging, os.O_RDONLY | os.O_DIRECTORY)


def _fsync_path(path: str, flags: int) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class Journal:
    new: tuple[str, ...]  # the files the killed write was putting in
    old: tuple[str, ...]  # the own files it was moving aside (replaced or stale)


def recover(target: str, owns: Callable[[str], bool], say: Callable[[str], None] | None = None) -> list[str]:
    """Finishes or clears what killed writes to the local folder `target` left beside it; returns
    the lines said. A staging folder with a journal: the swap had begun, so it is finished (the
    journal's old files still in `target` moved aside, its new ones still staged moved in), and
    `target` holds the new set. Without one: the swap had not begun and `target` holds the old
    set; the staging folder (the staged files only) is removed. Either way no staging folder of
    this module's stays, unless it is not one it can vouch for: then it is left, and said."""
    target = places.resolved(target)
    beside, prefix = os.path.dirname(target), _staging_prefix(target)
    tell = say or (lambda line: print(line, file=sys.stderr, flush=True))
    pattern = re.compile(re.escape(prefix) + _TEMP_NAME)
    try:
        names = sorted(n for n in os.listdir(beside) if pattern.fullmatch(n))
    except OSError:
        return []
    lines = []
    for name in names:
        line = _recover_one(target, os.path.join(beside, name), owns)
        if line:
            tell(line)
            lines.append(line)
    return lines


def _recover_one(target: str, staging: str, owns: Callable[[str], bool]) -> str | None:
    try:
        st = os.lstat(staging)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return None  # not a folder this user's runs made: not ours to judge
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a live write holds it
        except OSError:
            pass  # a file system without locks: its writers went on unguarded too
        journal_path = os.path.join(staging, JOURNAL)
        try:
            if not os.path.lexists(journal_path):
                return _clear_unstarted(target, staging)
            journal = _read_journal(journal_path, owns)
            if isinstance(journal, str):
                return f"{target}: left {staging} as it is: {journal}; look at its files, then remove it"
            return _finish(target, staging, journal)
        except OSError as e:  # a folder this user may read but not change (another's adapter, a read-only mount)
            return (f"{target}: {staging} holds a write killed midway that cannot be finished here "
                    f"({e.strerror or e}); rerun the command that wrote {target}")
    finally:
        os.close(fd)


def _clear_unstarted(target: str, staging: str) -> str:
    aside = os.path.join(staging, PREVIOUS)
    if os.path.isdir(aside) and not os.path.islink(aside) and os.listdir(aside):
        # An older version's swap kept no journal: these may be the only copies of the old files.
        return (f"{target}: left {staging} as it is: it holds a killed write's replaced files ({PREVIOUS}/) and no "
                "journal to finish it by; look at them, then remove it")
    shutil.rmtree(staging, ignore_errors=True)
    return (f"{target}: removed {os.path.basename(staging)}, the staging folder of a write killed before it changed "
            "anything; the folder's own files are as they were")


def _read_journal(path: str, owns: Callable[[str], bool]) -> Journal | str:
    """The journal, read as a stranger's file, or why it is not one (a phrase)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return f"its {JOURNAL} cannot be read"
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return f"its {JOURNAL} is not a file"
        data = f.read(MAX_JOURNAL_BYTES + 1)
    if len(data) > MAX_JOURNAL_BYTES:
        return f"its {JOURNAL} is over {MAX_JOURNAL_BYTES} bytes"
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return f"its {JOURNAL} is not JSON"
    if not isinstance(record, dict) or set(record) != {"format", "new", "old"} or record["format"] != JOURNAL_FORMAT:
        return f"its {JOURNAL} is not a journal of this version ({JOURNAL_FORMAT})"
    lists = (record["new"], record["old"])
    if not all(isinstance(v, list) and len(v) <= MAX_JOURNAL_NAMES and all(isinstance(n, str) for n in v) for v in lists):
        return f"its {JOURNAL} does not hold two lists of names"
    bad = [n for v in lists for n in v if not _is_plain(n) or not owns(n)]
    if bad or len(set(record["new"])) != len(record["new"]) or len(set(record["old"])) != len(record["old"]):
        return f"its {JOURNAL} names files this command does not write ({', '.join(map(repr, bad[:3]))})"
    return Journal(tuple(record["new"]), tuple(record["old"]))


def _finish(target: str, staging: str, journal: Journal) -> str:
    """Rolls the killed swap forward. Its old files all moved aside before its first new one
    moved in: an old name not yet in .previous/ is still the old file."""
    aside = os.path.join(staging, PREVIOUS)
    missing = [n for n in journal.new
               if not os.path.isfile(os.path.join(staging, n)) and not os.path.isfile(os.path.join(target, n))]
    if missing or (journal.old and not os.path.isdir(aside)):
        return (f"{target}: left {staging} as it is: its journal names files that are neither staged "
                f"nor in the folder ({', '.join(missing[:3]) or PREVIOUS}); look at them, then remove it")
    os.makedirs(target, exist_ok=True)
    for name in journal.old:
        here = os.path.join(target, name)
        if not os.path.lexists(os.path.join(aside, name)) and os.path.isfile(here) and not os.path.islink(here):
            os.replace(here, os.path.join(aside, name))
    placed = 0
    for name in journal.new:
        if os.path.isfile(os.path.join(staging, name)):
            os.replace(os.path.join(staging, name), os.path.join(target, name))
            placed += 1
    shutil.rmtree(staging, ignore_errors=True)
    return (f"{target}: finished the swap of a write killed midway ({placed} of its {len(journal.new)} new files "
            f"moved in now; the {len(journal.old)} old ones it replaced removed): the folder holds that write whole")


def _is_plain(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and os.sep not in name and "\0" not in name \
        and not name.startswith(".")


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
