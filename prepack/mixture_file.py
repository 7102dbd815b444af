"""Reading a `--mixture` file, local or gs://, for `prepack pack`, `prepack preflight` and the Dataflow launcher.

The file is read through the one storage interface (prepack/storage), at most MAX_FILE_BYTES + 1
bytes of it (a ranged read on gs://, so a huge object is never downloaded), and its bytes go to
the one validator (prepack/packing/mixture.parse_mixture), which resolves relative inputs
against the file's own folder, gs:// included. Above the core's rooms because it joins two of
them: storage (rank 2) and packing (rank 1).

A mixture file does not reach outside its own storage unless the user says so: one on gs://
(anyone with write access to the bucket may have written it) names gs:// inputs and Hub or TFDS
datasets only. A local path in it, which would make the job read this machine's files and copy
their bad lines into the output's dead letter, is refused in one line unless the command was
given `--allow-local-inputs`.
"""

from __future__ import annotations

from prepack.packing.mixture import MAX_FILE_BYTES, Mixture, MixtureError, parse_mixture
from prepack.storage import on_this_machine, storage_for

ALLOW_LOCAL_FLAG = "--allow-local-inputs"


def load_mixture(path: str, allow_local_inputs: bool = False) -> Mixture:
    """Reads and validates a mixture file (local or gs://); raises MixtureError with one line.
    allow_local_inputs: a gs:// file may name local paths (the user said so)."""
    where = f"mixture file {path}"
    try:
        data = storage_for(path).read_head(path, MAX_FILE_BYTES + 1)
    except ValueError as e:  # a gs:// path without a bucket
        raise MixtureError(f"{where}: cannot be read ({e})") from None
    except OSError as e:
        raise MixtureError(f"{where}: cannot be read ({e.strerror or e})") from None
    if data is None:
        raise MixtureError(f"{where}: cannot be read (no such file); check the path")
    mixture = parse_mixture(data, path)
    if not on_this_machine(path) and not allow_local_inputs:
        for source in mixture.sources:
            local = next((spec for spec in source.inputs if on_this_machine(spec)), None)
            if local is not None:
                raise MixtureError(
                    f"{where}: source {source.name!r} names the local path {local!r}; a mixture file on gs:// names "
                    f"gs:// inputs only (it could make the job read this machine's files): pass {ALLOW_LOCAL_FLAG} if "
                    "you mean it")
    return mixture
