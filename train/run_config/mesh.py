"""`--mesh fsdp=F,tp=T`: the device mesh a run trains on.

Tunix shards each batch along 'fsdp' and pre-shards the optimizer only when the mesh is active
through the legacy `with mesh:` context (jax.set_mesh leaves pxla's thread-local mesh empty in
jax 0.10.2), so the trainer trains inside `with mesh:`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prepack.hostile_input.untrusted import shown
from train.run_config.config import TrainError

MESH_AXES = ("fsdp", "tp")

def parse_mesh(spec: str | None) -> dict[str, int] | None:
    """'fsdp=2,tp=1' -> {'fsdp': 2, 'tp': 1}; missing axes default to 1."""
    if not spec:
        return None
    sizes = {axis: 1 for axis in MESH_AXES}
    given: set[str] = set()
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in MESH_AXES:
            raise TrainError(f"--mesh {shown(spec)}: expected comma-separated fsdp=N,tp=M")
        if key in given:  # the last value would silently win
            raise TrainError(f"--mesh {shown(spec)}: {key} is given twice; give each axis once, e.g. fsdp=2,tp=1")
        given.add(key)
        if not value.strip().isdigit() or len(value.strip()) > 6 or int(value) < 1:  # no device count has 7 digits
            raise TrainError(f"--mesh {shown(spec)}: {key} size {shown(value)} is not a positive whole number of devices")
        sizes[key] = int(value)
    return sizes


def make_mesh(sizes: Mapping[str, int] | None, batch_size: int) -> Any:
    if sizes is None:
        return None
    import jax

    if batch_size % sizes["fsdp"]:
        # Tunix would silently replicate the batch instead of sharding it.
        raise TrainError(f"--batch-size {batch_size} must be divisible by fsdp={sizes['fsdp']}")
    needed = sizes["fsdp"] * sizes["tp"]
    if needed != jax.device_count():
        raise TrainError(
            f"--mesh fsdp={sizes['fsdp']},tp={sizes['tp']} needs {needed} devices; {jax.device_count()} are visible"
            + (" (on CPU, --cpu-devices N fakes N devices)" if jax.default_backend() == "cpu" else "")
        )
    return jax.make_mesh(
        (sizes["fsdp"], sizes["tp"]), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
