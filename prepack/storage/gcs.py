"""gs:// paths and the one google-cloud-storage client, shared by the job's publishing and the loader.

google-cloud-storage is imported on first use only, so the core stays light; the client
honors STORAGE_EMULATOR_HOST, which the tests' local GCS emulator sets.
"""

from __future__ import annotations

import functools
import os

GCS_PREFIX = "gs://"


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
