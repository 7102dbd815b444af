"""gs:// behind the storage interface, through the one google-cloud-storage client.

google-cloud-storage is imported on first use only, so the core stays light; the client
honors STORAGE_EMULATOR_HOST, which the tests' local GCS emulator sets.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import BinaryIO

from prepack.format.manifest import ManifestError
from prepack.storage.interface import STREAM_BUFFER_BYTES, Version, Versioned, over_limit, refused, SwitchRefused
from prepack.storage.patterns import folder_pattern, has_wildcard, literal_head, pattern_regex

GCS_PREFIX = "gs://"
DOUBLY_COMPRESSED_TYPES = ("application/gzip", "application/x-gzip")


def is_gcs(path: str) -> bool:
    return path.startswith(GCS_PREFIX)


def split_gcs(path: str) -> tuple[str, str]:
    """(bucket, key) of a gs:// path."""
    bucket, _, key = path[len(GCS_PREFIX):].partition("/")
    if not bucket:
        raise ValueError(f"{path}: a gs:// path needs a bucket name")
    return bucket, key


@functools.lru_cache(maxsize=None)
def _client(emulator: str | None):  # keyed by the emulator so tests can switch it
    from google.cloud import storage

    return storage.Client()


def gcs_client():
    return _client(os.environ.get("STORAGE_EMULATOR_HOST"))


def object_stamp(path: str) -> tuple[int, int]:
    """(size, generation) of a gs:// object, (-1, 0) when there is none: a new upload under the
    same name always gets a new generation, whatever its size and however soon."""
    bucket, key = split_gcs(path)
    blob = gcs_client().bucket(bucket).get_blob(key)
    return (-1, 0) if blob is None else (int(blob.size), int(blob.generation))




class GcsStorage:
    absent: Version = 0
    os_locks = False

    @staticmethod
    def _blob(path: str, generation: int | None = None):
        bucket, key = split_gcs(path)
        return gcs_client().bucket(bucket).blob(key, generation=generation)

    def read(self, path: str, limit: int | None = None) -> Versioned | None:
        from google.api_core import exceptions

        for _ in range(5):
            blob = self._blob(path)
            try:
                blob.reload()
            except exceptions.NotFound:
                return None
            over_limit(path, int(blob.size or 0), limit)  # before any byte is downloaded
            generation = int(blob.generation)  # read first: a download may reset the blob's properties
            try:
                return Versioned(blob.download_as_bytes(if_generation_match=generation), generation)
            except (exceptions.NotFound, exceptions.PreconditionFailed):
                continue  # replaced between the two requests: read the new one
        raise RuntimeError(f"{path} keeps changing while it is read")

    def version(self, path: str) -> Version:
        from google.api_core import exceptions

        blob = self._blob(path)
        try:
            blob.reload()
        except exceptions.NotFound:
            return self.absent
        return int(blob.generation)

    def exists(self, path: str) -> bool:
        return self._blob(path).exists()

    def is_file(self, path: str) -> bool:
        return bool(split_gcs(path)[1]) and self._blob(path).exists()

    def write(self, path: str, data: bytes) -> None:
        self._blob(path).upload_from_string(data)

    def _upload_if(self, path: str, data: bytes, expected: int) -> Version:
        from google.api_core import exceptions

        blob = self._blob(path)
        try:
            blob.upload_from_string(data, content_type="application/json", if_generation_match=int(expected))
            return int(blob.generation)
        except exceptions.PreconditionFailed as e:
            # A retry after a lost response meets its own first attempt: read it back (an object
            # larger than these bytes is not this call's, and is not downloaded).
            try:
                now = self.read(path, len(data))
            except ManifestError:
                raise refused(path, b"") from e
            if now is not None and now.data == data:
                return now.version
            raise refused(path, None if now is None else now.data) from e

    def create(self, path: str, data: bytes) -> Version | None:
        try:
            return self._upload_if(path, data, 0)
        except SwitchRefused:
            return None

    def write_if(self, path: str, data: bytes, expected: Version, tmp: str) -> Version:
        return self._upload_if(path, data, int(expected))

    def delete_if(self, path: str, version: Version) -> bool:
        from google.api_core import exceptions

        try:
            self._blob(path).delete(if_generation_match=int(version))
        except exceptions.PreconditionFailed:
            return False  # a later generation under the same name: not the file this run replaced
        except exceptions.NotFound:
            return False  # gone already (a retried delete whose first attempt landed)
        return True

    def versions(self, folder: str) -> dict[str, Version]:
        bucket, key = split_gcs(folder)
        prefix = key.rstrip("/") + "/" if key else ""
        out = {}
        for blob in gcs_client().list_blobs(bucket, prefix=prefix, delimiter="/"):
            out[blob.name[len(prefix):]] = int(blob.generation)
        return out

    def list_files(self, folder: str) -> list[str]:
        bucket, key = split_gcs(folder)
        prefix = key.rstrip("/") + "/" if key else ""
        return [f"{GCS_PREFIX}{bucket}/{b.name}" for b in gcs_client().list_blobs(bucket, prefix=prefix)]

    def size(self, path: str) -> int:
        return 0  # not summed on gs:// (a request per file)

    def delete(self, paths: list[str]) -> None:
        from google.api_core import exceptions

        for path in paths:
            try:
                self._blob(path).delete()
            except exceptions.NotFound:
                pass

    def move(self, sources: list[str], targets: list[str]) -> None:
        """Copy, then delete: gs:// has no rename (what Beam's FileSystems.rename does too)."""
        client = gcs_client()
        for source, target in zip(sources, targets):
            (src_bucket, src_key), (dst_bucket, dst_key) = split_gcs(source), split_gcs(target)
            blob = client.bucket(src_bucket).blob(src_key)
            client.bucket(src_bucket).copy_blob(blob, client.bucket(dst_bucket), dst_key)
        self.delete(sources)

    def delete_tree(self, folder: str) -> None:
        self.delete(self.list_files(folder))

    def remove_if_empty(self, folder: str) -> None:
        pass  # gs:// has no folders

    def read_bytes(self, path: str) -> bytes | None:
        from google.api_core import exceptions

        try:
            return self._blob(path).download_as_bytes(raw_download=True)
        except exceptions.NotFound:
            return None

    def read_head(self, path: str, limit: int) -> bytes | None:
        """One ranged GET; the client's errors (no access, no credentials) become one-line OSErrors."""
        from google.api_core import exceptions
        from google.auth.exceptions import GoogleAuthError

        try:
            return self._blob(path).download_as_bytes(start=0, end=limit - 1, raw_download=True)
        except exceptions.NotFound:
            return None
        except exceptions.RequestRangeNotSatisfiable:
            return b""  # an empty object has no byte 0
        except exceptions.GoogleAPICallError as e:
            raise OSError(f"{e.code} {' '.join(str(e.message).split())[:200]}") from None
        except GoogleAuthError as e:
            raise OSError(f"no Google Cloud credentials ({' '.join(str(e).split())[:200]})") from None

    def replace(self, path: str, data: bytes, content_type: str = "application/json") -> None:
        self._blob(path).upload_from_string(data, content_type=content_type)

    def sizes(self, folder: str, names: list[str]) -> dict[str, int | None]:
        """One listing of the folder answers all names, instead of a request per shard."""
        bucket, key = split_gcs(folder)
        prefix = key.rstrip("/") + "/" if key else ""
        listed = {b.name[len(prefix):]: b.size for b in gcs_client().bucket(bucket).list_blobs(prefix=prefix)}
        return {n: listed.get(n) for n in names}

    def chunks(self, path: str, block: int) -> Iterator[bytes]:
        with self._blob(path).open("rb", chunk_size=block) as f:
            yield from iter(lambda: f.read(block), b"")

    def download(self, path: str, out: BinaryIO) -> None:
        """The whole object with one GET; GCS's own checksum is skipped (callers compare a sha256)."""
        self._blob(path).download_to_file(out, raw_download=True, checksum=None)

    def open_stream(self, path: str, buffer_bytes: int = STREAM_BUFFER_BYTES) -> BinaryIO:
        """The object's stored bytes (raw: a gzip-encoded object is not decoded), seekable;
        FileNotFoundError when there is none."""
        from google.cloud.storage.fileio import BlobReader

        bucket, key = split_gcs(path)
        blob = gcs_client().bucket(bucket).get_blob(key)  # its size and encoding, for seeks from the end
        if blob is None:
            raise FileNotFoundError(f"{path}: no such object")
        if blob.content_encoding == "gzip" and blob.content_type in DOUBLY_COMPRESSED_TYPES:
            # GCS serves such an object badly (a download can loop); Beam's reader refused it too.
            raise OSError(f"{path}: a gzip file stored with Content-Encoding: gzip (compressed twice) cannot be read; "
                          "upload it again without that Content-Encoding")
        return BlobReader(blob, chunk_size=buffer_bytes, raw_download=True)

    def create_stream(self, path: str) -> BinaryIO:
        """A resumable upload in STREAM_BUFFER_BYTES chunks; the object appears when it closes."""
        from google.cloud.storage.fileio import BlobWriter

        return BlobWriter(self._blob(path), content_type="application/octet-stream", chunk_size=STREAM_BUFFER_BYTES,
                          ignore_flush=True)

    def match(self, pattern: str) -> list[tuple[str, int]]:
        """One metadata request for a plain path; one listing from the pattern's literal head for a glob."""
        pattern = folder_pattern(pattern)
        bucket, key = split_gcs(pattern)
        client = gcs_client()
        if not has_wildcard(key):
            blob = client.bucket(bucket).get_blob(key)
            return [] if blob is None else [(pattern, int(blob.size))]
        regex = pattern_regex(pattern)
        listed = ((f"{GCS_PREFIX}{bucket}/{b.name}", int(b.size)) for b in client.list_blobs(bucket, prefix=literal_head(key)))
        return sorted(item for item in listed if regex.match(item[0]))
