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
