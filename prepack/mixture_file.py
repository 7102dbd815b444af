"""A mixture file read from where it lives, a local path or gs://, through the one storage interface.

`prepack pack --mixture`, `prepack preflight --mixture` and `gcp/launch_dataflow.py --mixture`
read the file here: at most MAX_FILE_BYTES + 1 bytes (a ranged read on gs://, so an oversized
object is refused without downloading it), then prepack.packing.mixture.parse_mixture validates
the bytes and resolves relative inputs against the file's own folder. This sits above the core's
rooms because packing, where the mixture rule lives, does not reach up into storage.
"""

from __future__ import annotations

from prepack import storage
from prepack.packing.mixture import MAX_FILE_BYTES, Mixture, MixtureError, parse_mixture


def load_mixture(path: str) -> Mixture:
    """Reads and validates a mixture file, local or gs://; raises MixtureError with one line."""
    where = f"mixture file {path}"
    try:
        data = storage.read_head(path, MAX_FILE_BYTES + 1)
    except ValueError as e:  # a gs:// URL without a bucket
        raise MixtureError(f"{where}: {e}") from None
    except OSError as e:
        raise MixtureError(f"{where}: cannot be read ({e.strerror or e})") from None
    if data is None:
        raise MixtureError(f"{where}: cannot be read (no such file or object); check the path")
    return parse_mixture(data, path)
