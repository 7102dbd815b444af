"""The memory-path options of `prepack train`: --loss-chunk-tokens, --attention, --attention-tile, --remat.

Each maps a TrainConfig field onto Tunix's own pieces, without forking them:
- choose_sft_loss(cfg): SFT's loss by --loss and --loss-chunk-tokens: the full-logits masked
  loss (chunk 0, the reference), the chunked one (train/step/chunked_loss.py), or Tunix's default (for
  comparisons; never chunked); the run's objective (train/objectives/) chooses its own loss;
- gen_model_input_fn(cfg): the [B, L, L] mask for dense attention, the [B, L] segment ids
  themselves otherwise (train/attention_kernels/attention.py installs layers that read them, with the tile or
  block of --attention-tile or the kind's default); the objective adds what its loss reads;
- set_remat(model, on): the decoder layers under one lax.scan whose body is checkpointed
  (train/step/layer_scan.py: each layer recomputed from its input in the backward pass), on an
  already-built model, so `auto` can switch it after planning. Not Tunix's
  `RematConfig.DECODER`: XLA merges that per-layer recomputation back into the forward pass
  on CPU (layer_scan.py says how), so it saved nothing in the CPU plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from flax import nnx

from train.attention_kernels import attention as attention_lib
from train.run_config.config import TrainConfig, TrainError
from train.step import loss as loss_lib

REMAT_NONE, REMAT_LAYER, REMAT_AUTO = "none", "layer", "auto"
REMATS = (REMAT_NONE, REMAT_LAYER, REMAT_AUTO)

def attention_kind(cfg: TrainConfig) -> str:
    kind = cfg.attention or attention_lib.default_kind()
    if kind not in attention_lib.KINDS:
        raise TrainError(f"unknown --attention {kind!r}; choose one of {', '.join(attention_lib.KINDS)}")
    return kind


def attention_tile(cfg: TrainConfig, max_length: int) -> int:
    """--attention-tile, else the kind's default tile cut to divide L (the largest divisor of L up to it)."""
    if cfg.attention_tile is not None:
        return cfg.attention_tile
    return math.gcd(max_length, attention_lib.default_tile(attention_kind(cfg)))


def check_tile(cfg: TrainConfig, max_length: int) -> None:
    """--attention-tile, and the tile a kind would use, against what its kernel can cut."""
    import jax

    kind, tile = attention_kind(cfg), cfg.attention_tile
    if tile is not None:
        if kind == attention_lib.DENSE:
            raise TrainError("--attention-tile is for --attention blocked, flash or splash; dense has no tiles")
        if tile < 1 or max_length % tile:
            raise TrainError(f"--attention-tile must divide the shards' max_length {max_length}, got {tile}")
    used = attention_tile(cfg, max_length)
    flag = f"--attention-tile {tile}" if tile is not None else f"the default block {used} (the largest that divides L {max_length})"
    if kind == attention_lib.FLASH and jax.default_backend() == "gpu" and (used < 16 or used & (used - 1)):
        raise TrainError(f"--attention flash on a GPU needs blocks that are powers of two, at least 16 (Triton); {flag} is not")
    lanes = attention_lib.SPLASH_LANES
    if used % lanes and (kind == attention_lib.SPLASH or (kind == attention_lib.FLASH and _on_tpu())):
        raise TrainError(f"--attention {kind}{' on a TPU' if kind == attention_lib.FLASH else ''} needs blocks that are "
                         f"multiples of {lanes}; {flag} is not")


def _on_tpu() -> bool:
    import jax

    return jax.default_backend() == "tpu"


def check_options(cfg: TrainConfig, max_length: int) -> None:
    """Refuses memory-path options that cannot work, before any weights load."""
    attention_kind(cfg)
    check_loss_mean(cfg)
    if cfg.remat not in REMATS:
        raise TrainError(f"unknown --remat {cfg.remat!r}; choose one of {', '.join(REMATS)}")
    if cfg.loss_chunk_tokens < 0:
        raise TrainError(f"--loss-chunk-tokens must be 0 (full logits) or positive, got {cfg.loss_chunk_tokens}")
    check_loss_kernel(cfg)
    budget = cfg.memory_budget_gib
    # Any finite positive budget is a budget (0.01 GiB too: the plan then says nothing fits); inf
    # was an OverflowError in int(inf * GiB), and nan compares false with everything.
    if budget is not None and not (isinstance(budget, (int, float)) and not isinstance(budget, bool)
                                   and math.isfinite(budget) and budget > 0):
        raise TrainError(f"--memory-budget-gib must be a finite number of GiB above 0, got {budget}")
    if attention_kind(cfg) == attention_lib.SPLASH and max_length % attention_lib.SPLASH_LANES:
        raise TrainError(f"--attention splash needs a max_length that is a multiple of {attention_lib.SPLASH_LANES}; "
                         f"the shards' is {max_length}: use --attention blocked")
    if attention_kind(cfg) == attention_lib.FLASH and _on_tpu() and max_length % attention_lib.SPLASH_LANES:
        raise TrainError(f"--attention flash on a TPU needs a max_length that is a multiple of {attention_lib.SPLASH_LANES}; "
                         f"the shards' is {max_length}: use --attention blocked")
    check_tile(cfg, max_length)


def check_loss_kernel(cfg: TrainConfig) -> None:
    """--loss-kernel fused is refused where it would not compute the XLA path's loss (auto falls back)."""
    from train.step import fused_head

    if cfg.loss_kernel not in fused_head.KINDS:
        raise TrainError(f"unknown --loss-kernel {cfg.loss_kernel!r}; choose one of {', '.join(fused_head.KINDS)}")
    if cfg.loss_kernel != fused_head.FUSED:
        return
    if cfg.loss_chunk_tokens == 0 or cfg.loss == "tunix-default":
        raise TrainError("--loss-kernel fused computes the chunked loss: it needs --loss masked and --loss-chunk-tokens > 0")
    reason = fused_head.reason_unfused(cfg.dtype, None) or fused_head.check_chunk(cfg.loss_chunk_tokens)
    if reason:
        raise TrainError(f"--loss-kernel fused cannot run with {reason}; use --loss-kernel xla or auto")


def check_loss_mean(cfg: TrainConfig) -> None:
    if cfg.loss_mean not in loss_lib.LOSS_MEANS:
        raise TrainError(f"unknown --loss-mean {cfg.loss_mean!r}; choose one of {', '.join(loss_lib.LOSS_MEANS)}")
    if cfg.loss_mean != loss_lib.TOKEN_MEAN and cfg.loss == "tunix-default":
        # Tunix's default is a token mean with no segment ids: it cannot weigh examples.
        raise TrainError(f"--loss-mean {cfg.loss_mean} needs --loss masked (tunix-default is a token mean only)")


def choose_sft_loss(cfg: TrainConfig) -> Callable[..., Any]:
    """SFT's has_aux loss, as --loss, --loss-mean, --loss-chunk-tokens and --loss-kernel choose it."""
    check_loss_mean(cfg)
    if cfg.loss == "tunix-default":
        return loss_lib.with_aux(loss_lib.tunix_default_loss_fn())
    if cfg.loss != "masked":
        raise TrainError(f"unknown loss {cfg.loss!r}; choose masked or tunix-default")
    if cfg.loss_chunk_tokens == 0:
        return loss_lib.make_masked_loss_fn(cfg.loss_mean)
    from train.step.chunked_loss import make_chunked_loss_fn

    return make_chunked_loss_fn(cfg.loss_chunk_tokens, cfg.loss_mean, cfg.loss_kernel)


def gen_model_input_fn(cfg: TrainConfig) -> Callable[..., Any]:
    from train.step import model_inputs

    return model_inputs.make_gen_model_input_fn(attention=attention_kind(cfg), loss_mean=cfg.loss_mean)


def install_attention(model: nnx.Module, cfg: TrainConfig, max_length: int) -> None:
    """After apply_lora: the layers read segment ids (blocked, flash, splash) or stay Tunix's (dense)."""
    attention_lib.install(model, attention_kind(cfg), attention_tile(cfg, max_length))


def set_remat(model: nnx.Module, on: bool, scan_layers: bool = False) -> None:
    """Remat on: the layers scanned, each recomputed. Off: Tunix's loop, or (scan_layers) a scan without remat."""
    from train.step import layer_scan

    layer_scan.set_scan(model, on or scan_layers, remat=on)


def remat_is_on(model: nnx.Module) -> bool:
    from train.step import layer_scan

    return layer_scan.remat_is_on(model)
