"""Reading a `--mixture` file, local or gs://, for `prepack pack`, `prepack preflight` and the Dataflow launcher.

The file is read through the one storage interface (prepack/storage), at most MAX_FILE_BYTES + 1
bytes of it (a ranged read on gs://, so a huge object is never downloaded), and its bytes go to
the one validator (prepack/packing/mixture.parse_mixture), which resolves relative inputs
against the file's own folder, gs:// included. Above the core's rooms because it joins two of
them: storage (rank 2) and packing (rank 1).
"""

from __future__ import annotations

from prepack.packing.mixture import MAX_FILE_BYTES, Mixture, MixtureError, parse_mixture
from prepack.storage import storage_for


def load_mixture(path: str) -> Mixture:
    """Reads and validates a mixture file (local or gs://); raises MixtureError with one line."""
    where = f"mixture file {path}"
    try:
        data = storage_for(path).read_head(path, MAX_FILE_BYTES + 1)
    except ValueError as e:  # a gs:// path without a bucket
        raise MixtureError(f"{where}: cannot be read ({e})") from None
    except OSError as e:
        raise MixtureError(f"{where}: cannot be read ({e.strerror or e})") from None
    if data is None:
        raise MixtureError(f"{where}: cannot be read (no such file); check the path")
    return parse_mixture(data, path)
