"""How a local file a command writes is written: as a new file, never through the old one.

Opening an existing name for writing ("w", "wb", "a") writes into whatever file that name
reaches: a hard link to an input (`ln SET/manifest.json m.jsonl`, then `--metrics-out m.jsonl
--overwrite`) turned the shard set's manifest into metrics JSONL. So every whole-file output is
written here as a new file beside its target (created exclusively: never an existing name, never
through a link planted at the temporary name) and renamed over the target once it is whole. The
rename replaces the name only: the old file, and every other name it has, keeps its bytes, and a
failed or killed write leaves the old file as it was (and at most its temporary file beside it).

The one output that is extended instead of replaced, a resumed run's metrics JSONL, is appended
to only when `append_problem` finds nothing against it: the file has no other name (one link)
and is none of the run's inputs (device and inode).

`storage.write_text` and `LocalStorage.replace` write through `new_file`; so do the commands'
own writers (reports, preflight tables and plots, the metrics JSONL).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Iterator
from typing import IO

# How many entries of an input folder are looked at for the same-file check (a shard set holds
# its manifest and shards, a weights folder a few files): a bound, not a limit any real set meets.
MAX_INPUT_ENTRIES = 100_000


def create_beside(path: str) -> tuple[int, str]:
    """A new, empty file next to `path` (same folder, so a rename is atomic): (fd open for
    writing, its path). Made with O_EXCL and O_NOFOLLOW: it is never a file that existed before.
    Its mode is what a plain open would give (0666 less the umask), not mkstemp's 0600."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    base = os.path.basename(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    while True:
        tmp = os.path.join(folder, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def new_file(path: str, mode: str = "wb", **open_args: object) -> Iterator[IO]:
    """Yields a new file opened with `mode` ("w" or "wb", plus open's keyword arguments such as
    newline); on a clean exit it is closed and renamed over `path`, on an error removed (the old
    file stays as it was)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"new_file writes a new file: mode 'w' or 'wb', not {mode!r}")
    fd, tmp = create_beside(path)
    try:
        with os.fdopen(fd, mode, **open_args) as f:  # type: ignore[call-overload]
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_bytes(path: str, data: bytes) -> None:
    """The whole file `path` is `data`: written new beside it and renamed over it."""
    with new_file(path) as f:
        f.write(data)


def same_files(inputs: Iterable[str]) -> dict[tuple[int, int], str]:
    """(device, inode) -> path of each regular file among `inputs` (files, or folders walked to
    MAX_INPUT_ENTRIES entries in all); inputs that are not local or cannot be read are skipped."""
    found: dict[tuple[int, int], str] = {}
    left = MAX_INPUT_ENTRIES
    for given in inputs:
        if "://" in given or not os.path.exists(given):
            continue
        for path in _files_under(given):
            if left == 0:
                return found
            left -= 1
            with contextlib.suppress(OSError):
                st = os.stat(path)
                found.setdefault((st.st_dev, st.st_ino), path)
    return found


def _files_under(path: str) -> Iterator[str]:
    if not os.path.isdir(path):
        yield path
        return
    for root, _, names in os.walk(path):
        yield from (os.path.join(root, n) for n in sorted(names))


def append_problem(path: str, inputs: Iterable[str] = ()) -> str | None:
    """Why the existing file `path` may not be appended to (the end of a one-line refusal), or
    None: appending writes into the file itself, so it must have no other name (hard link) and
    be none of the run's inputs."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if st.st_nlink != 1:
        return (f"has {st.st_nlink} links (another name reaches the same file: `ln`), and appending would change "
                "that file too")
    same = same_files(inputs).get((st.st_dev, st.st_ino))
    if same is not None:
        return f"is the same file as the input {same}"
    return None
