"""The machine line every device figure names: device kind, backend, jax, jaxlib and libtpu versions.

`versions()` reads the installed distributions only (importlib.metadata): it imports no JAX and
opens no device, so a parent process that spawns the processes holding the chip can call it.
`machine()` opens the backend (call it only in the process that holds the device).
"""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

DISTRIBUTIONS = ("jax", "jaxlib", "libtpu", "libtpu-nightly")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def machine() -> dict[str, Any]:
    """versions() and the device this process holds (opens the backend)."""
    import jax

    info: dict[str, Any] = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                            "devices": jax.device_count(), **versions()}
    try:
        from jax.extend import backend as jex_backend

        info["platform_version"] = jex_backend.get_backend().platform_version  # libtpu's build on a TPU
    except Exception:  # noqa: BLE001 - not every backend says
        pass
    return info


def line(info: dict[str, Any]) -> str:
    """One line: 'TPU v5 lite (tpu), jax 0.10.2, jaxlib 0.10.2, libtpu 0.0.x'."""
    parts = [f"{info.get('device', '?')} ({info.get('backend', '?')})"]
    parts += [f"{d} {info[d]}" for d in DISTRIBUTIONS if d in info]
    return ", ".join(parts)
