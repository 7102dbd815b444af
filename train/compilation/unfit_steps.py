"""Train steps that did not fit without remat, remembered beside the compilation cache (`--remat auto`).

Why: on a TPU v5e, `--remat auto` for Qwen3 0.6B or Gemma3 1B at (8, 2048) first compiles the step
without remat, and the compiler refuses it only after more than 100 s (RESOURCE_EXHAUSTED); then the
step with remat compiles (~50 s) and is cached. The cache keeps executables, not refusals, so every
later run of that shape paid the refused compile again before step 1. Here a refusal, or a plan
whose peak exceeds the budget, is written down under the cache folder, keyed by the step as lowered
(its StableHLO without debug locations), the device kind, the backend's and JAX's versions: a later
run lowers the step (seconds), finds the verdict and goes straight to remat.

A verdict file is read as a stranger's: only a regular file inside the folder is read, at most
MAX_FILE_BYTES of it (train/compilation/cache_files.py: a FIFO or a link there is no verdict), its fields,
types and key are checked, and one that does not pass is ignored (the step is planned again). The worst a planted verdict can do is turn
remat on for a step that would fit: slower, never wrong. A verdict holds for budgets up to the one
it was found at. `--compile-cache off` remembers nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
from typing import Any

FOLDER = "prepack-unfit-steps"
MAX_FILE_BYTES = 4096
_KEY = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class UnfitStep:
    key: str
    budget_bytes: int  # the budget the step was planned against
    planned: str  # what the plan said, e.g. "21.40 GiB", or the compiler's refusal


def step_key(lowered: Any) -> str:
    """The lowered step's identity on this machine: its program, the device kind, the backend and JAX."""
    import jax

    device = jax.devices()[0]
    digest = hashlib.sha256(lowered.as_text(debug_info=False).encode())
    for part in (device.platform, device.device_kind, device.client.platform_version, jax.__version__):
        digest.update(b"\0" + str(part).encode())
    return digest.hexdigest()


def path_of(cache_folder: str, key: str) -> str:
    return os.path.join(cache_folder, FOLDER, f"{key}.json")


def any_remembered(cache_folder: str) -> bool:
    """Whether the folder holds any verdict (else no key need be computed to look one up)."""
    try:
        return any(name.endswith(".json") for name in os.listdir(os.path.join(cache_folder, FOLDER)))
    except OSError:
        return False


def recall(cache_folder: str, key: str, budget_bytes: int) -> UnfitStep | None:
    """The remembered verdict for this step, when there is a valid one that covers this budget."""
    from train.compilation import cache_files

    try:  # a regular file inside the folder, at most MAX_FILE_BYTES: a FIFO or a link there is no verdict
        raw = cache_files.read(cache_folder, f"{FOLDER}/{key}.json", MAX_FILE_BYTES) if _KEY.fullmatch(key) else None
        data = json.loads(raw) if raw is not None else None
    except (cache_files.NotRead, ValueError, RecursionError):
        return None
    verdict = _valid(data, key)
    return verdict if verdict is not None and budget_bytes <= verdict.budget_bytes else None


def _valid(data: Any, key: str) -> UnfitStep | None:
    if not isinstance(data, dict) or set(data) != {"key", "budget_bytes", "planned"}:
        return None
    budget, planned = data["budget_bytes"], data["planned"]
    if data["key"] != key or not _KEY.fullmatch(key):
        return None
    if type(budget) is not int or budget <= 0 or not isinstance(planned, str) or len(planned) > 300:
        return None
    return UnfitStep(key, budget, planned)


def remember(cache_folder: str, verdict: UnfitStep) -> str:
    """Writes the verdict (whole or not at all: a temporary file renamed over); returns its path."""
    path = path_of(cache_folder, verdict.key)
    from train.compilation import cache_files

    cache_files.make_folder(os.path.dirname(path))
    fd, tmp = tempfile.mkstemp(prefix=".unfit-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(verdict), f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
