"""Local copies of gs:// shards: one GET per shard instead of one per row.

array_record's own gs:// reader sends one HTTP request per record (an
open-ended range on a new connection), so a training host reading from GCS is
bound by request latency. SFT shard sets are small next to a TPU host's disk,
so the loader downloads each shard whole, once, and reads it locally.

Files are named by their content (the manifest's sha256, checked to be 64 hex
digits before it names anything: prepack.hostile_input.untrusted), which is checked while
downloading: a cached file is exactly the shard the manifest names, so it can be
shared by every set, process and run on the host, and is never stale. A lock file
per shard lets one process download it while others wait.

A cached copy can still rot on the host's disk (a flipped byte, a tool that wrote
into the folder). The cache heals instead of trusting it forever: with verify=True
a cached copy is hashed again, and one that fails its hash is dropped and
downloaded once more; a reader that finds a corrupt record in a cached copy calls
`drop` and fetches it again once (loaders/shards.py) before it reports the error.

The folder: cache_dir, else $PREPACK_SHARD_CACHE, else
$XDG_CACHE_HOME/prepack/shards (~/.cache/prepack/shards). Nothing is evicted:
delete the folder to reclaim the space. A download killed midway leaves a
`*.part-PID-THREAD` file that nothing reads; it may be deleted at any time.
"""

from __future__ import annotations

import fcntl
import os
import threading

from prepack import storage
from prepack.hostile_input import untrusted

CACHE_ENV = "PREPACK_SHARD_CACHE"
SUFFIX = ".array_record"


def default_cache_dir() -> str:
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "prepack", "shards")


class ShardCacheError(OSError):
    """A shard could not be copied into the cache (disk full, permissions, network)."""


class ShardDigestError(ValueError):
    """A downloaded shard's bytes are not the ones the manifest names."""


class ShardCache:
    """Content-addressed local copies of remote shard files."""

    def __init__(self, folder: str | None = None):
        self.folder = os.path.abspath(folder or default_cache_dir())

    def __repr__(self) -> str:
        return f"ShardCache({self.folder!r})"

    def path_for(self, sha256: str) -> str:
        # The name comes from a manifest: only 64 hex digits may name a file in the folder.
        untrusted.sha256_hex(sha256, "shard cache key", "sha256", ShardDigestError)
        return os.path.join(self.folder, sha256 + SUFFIX)

    def drop(self, sha256: str) -> None:
        """Removes a cached copy found corrupt, so that the next fetch downloads it again."""
        try:
            os.remove(self.path_for(sha256))
        except FileNotFoundError:
            pass

    def _intact(self, path: str, sha256: str, num_bytes: int, verify: bool) -> bool:
        if not self._complete(path, num_bytes):
            return False
        if verify and storage.sha256(path) != sha256:
            os.remove(path)  # rotted on this disk: fetched again below
            return False
        return True

    def _complete(self, path: str, num_bytes: int) -> bool:
        try:
            return os.path.getsize(path) == num_bytes
        except OSError:  # missing, or the folder is not one: fetch then says why
            return False

    def fetch(self, url: str, sha256: str, num_bytes: int, verify: bool = False) -> str:
        """The local path of the shard at `url`, downloading it first unless it is cached.

        verify: hash a cached copy again; one that differs is dropped and downloaded again.
        Raises ShardDigestError if the downloaded bytes differ from `sha256`,
        ShardCacheError if they cannot be written (the message says what to do).
        """
        final = self.path_for(sha256)
        if not verify and self._complete(final, num_bytes):
            return final
        try:
            os.makedirs(self.folder, exist_ok=True)
            with open(final + ".lock", "a+b") as lock:
                # One download per shard across threads and processes (flock locks
                # belong to the open file, so threads exclude each other too).
                fcntl.flock(lock, fcntl.LOCK_EX)
                if self._intact(final, sha256, num_bytes, verify):
                    return final
                self._download(url, final, sha256, num_bytes)
        except OSError as e:
            if isinstance(e, ShardCacheError):
                raise
            raise ShardCacheError(
                f"{url}: could not copy the shard into the local shard cache {self.folder} ({e}); "
                f"free space there, point cache_dir or ${CACHE_ENV} at a bigger disk, or read through a gcsfuse mount"
            ) from e
        return final

    def _download(self, url: str, final: str, sha256: str, num_bytes: int) -> None:
        tmp = f"{final}.part-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "wb") as out:
                size, digest = storage.download(url, out)
            if size != num_bytes or digest != sha256:
                raise ShardDigestError(
                    f"{url}: downloaded {size} bytes with sha256 {digest}, but the manifest says {num_bytes} bytes "
                    f"with sha256 {sha256}; the file is corrupt or was replaced"
                )
            os.replace(tmp, final)  # readers only ever see complete, checked files
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
