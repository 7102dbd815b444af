"""A train step that does not fit the device's memory: JAX's out-of-memory error, told in one line.

XLA reports a failed device (or host, on CPU) allocation as a JaxRuntimeError whose message
starts RESOURCE_EXHAUSTED (GPU and CPU: "Out of memory allocating N bytes"; TPU: "Ran out of
memory in memory space hbm"). Tunix's step raises it from inside its loop, 20-30 lines deep;
the user needs the shape that did not fit and a smaller one to try.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from train.run_config.config import TrainError

# Substrings of XLA's allocation-failure messages (CPU, GPU and TPU spell them differently).
OUT_OF_MEMORY_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "ran out of memory")
_BYTES = re.compile(r"allocating (\d+) bytes")


class OutOfMemory(TrainError):
    """The run's batch does not fit in memory; the message names the shape and a smaller batch size."""


def is_out_of_memory(error: BaseException) -> bool:
    """True for XLA's allocation failures (XlaRuntimeError is an alias of JaxRuntimeError)."""
    import jax

    if not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    text = str(error).lower()
    return any(marker.lower() in text for marker in OUT_OF_MEMORY_MARKERS)


def smaller_batch_size(batch_size: int, batch_divisor: int = 1) -> int | None:
    """Half the batch, rounded down to what the mesh's batch axis divides; None when nothing smaller is left."""
    half = (batch_size // 2) // batch_divisor * batch_divisor
    return half if half >= 1 else None


def out_of_memory_message(batch_size: int, max_length: int, model: str, error: BaseException | None = None,
                          batch_divisor: int = 1, remat_on: bool = False) -> str:
    """One line: what did not fit (batch size, L, model, the allocation XLA asked for) and what to try."""
    wanted = _BYTES.search(str(error)) if error is not None else None
    asked = f" (XLA asked for {int(wanted.group(1)) / 2**30:,.1f} GiB at once)" if wanted else ""
    head = (f"out of memory: a train step of --batch-size {batch_size} rows x L {max_length} "
            f"({batch_size * max_length:,} tokens) on --model {model} does not fit{asked}")
    remat = "" if remat_on else "--remat layer, "
    smaller = smaller_batch_size(batch_size, batch_divisor)
    if smaller is None:
        return (f"{head}; --batch-size is already {batch_size}: try {remat}a smaller --loss-chunk-tokens, "
                f"or shards packed for a shorter L (prepack pack --max-length {max(1, max_length // 2)})")
    return (f"{head}; try --batch-size {smaller} (check it first with --plan-memory --batch-size {smaller})"
            + (", or --remat layer" if not remat_on else ""))


@contextlib.contextmanager
def refused_as_train_error(setup: Any) -> Iterator[None]:
    """Turns XLA's out-of-memory error inside the block into OutOfMemory (a TrainError: one line, exit 2),
    described from the run's train.run_setup.Setup as it stands when the error comes (--remat auto may
    have switched remat on)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001  (re-raised unless it is XLA's allocation failure)
        if not is_out_of_memory(e):
            raise
        from train.step import memory_path

        cfg = setup.config
        divisor = int(setup.mesh.shape["fsdp"]) if setup.mesh is not None else 1
        raise OutOfMemory(out_of_memory_message(
            cfg.batch_size, setup.view.manifest.max_length, cfg.model, e, divisor,
            memory_path.remat_is_on(setup.built.model),
        )) from None
