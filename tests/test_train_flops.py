"""The analytic FLOP count (train/measurement/flops.py), --plan-memory's `flops` and `xla_flops`, and MFU (train/measurement/mfu.py).

- On the loop-free reference step (--attention dense --loss-chunk-tokens 0 --remat none) XLA's
  figure and the analytic one agree within 10% (XLA also counts elementwise work).
- Against the traced step with every loop counted by its trips (testkit/jaxpr_flops.py) the
  analytic count holds within 5% with the loss chunks and the layer scan (where XLA sees one body).
- Each attention kind's FLOPs per pair are those of its traced matrix products (flash's and
  splash's per kernel).
- The pairs each kind computes: flash's blocks are exactly those holding a same-segment causal
  pair (the block-level ideal), and the token-level ideal equals the mask's count.
- MFU: the peak table, the row and summary fields (null, never missing, without a peak).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from loaders import block_causal_mask
from testkit import jaxpr_flops
from testkit import train_batches as testing
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
from train import cli, memory_plan
from train.attention_kernels import attention, blocked_attention as ba
from train.measurement import flops, mfu
from train.measurement.metrics import MetricsRecorder
from train.model import models
from train.run_config.config import TrainConfig
from train.step import memory_path, model_inputs


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("flops") / "L256")
    build_shard_set(path, num_rows=8, max_length=256, tokenizer={**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": 4096})
    return path


@pytest.mark.parametrize("model", ["tiny-gemma3", "tiny-qwen3"])
def test_analytic_flops_agree_with_xla_on_the_loop_free_reference_step(shards, capsys, model) -> None:
    args = ["--shards", shards, "--model", model, "--lora-rank", "4", "--batch-size", "2", "--plan-memory",
            "--attention", "dense", "--loss-chunk-tokens", "0", "--remat", "none"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["flops"] == pytest.approx(result["xla_flops"], rel=0.10)
    assert result["flops"] == pytest.approx(sum(result["flops_parts"].values()))
    assert result["attention_pairs_per_row"]["global"] == 256 * 256  # dense: every score of L x L
    assert any(line.startswith("  XLA FLOPs") and "loop body once" in line for line in out)


def test_the_default_path_counts_what_xla_cannot_see(shards, capsys) -> None:
    """Chunked loss and blocked attention are loops: XLA's figure falls short, the analytic one does not."""
    assert cli.main(["--shards", shards, "--model", "tiny-gemma3", "--lora-rank", "4", "--batch-size", "2", "--plan-memory",
                     "--attention", "blocked", "--attention-tile", "32", "--loss-chunk-tokens", "128", "--remat", "layer"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    parts = result["flops_parts"]
    assert parts["remat"] > 0 and result["flops"] > 1.2 * result["xla_flops"]
    # blocked at tile 32 on the set's packed rows computes less than L x L per row and head
    assert result["attention_pairs_per_row"]["global"] < 256 * 256


def step_count(name, kind, chunk, remat, length=256, tile=None):
    """(traced dot FLOPs of the LoRA gradient, analytic) for one packed batch of two rows."""
    built = models.build_model(name, vocab_size=512, seed=1)
    model = models.apply_lora(built.model, built.spec, rank=4)
    tile = tile or length
    attention.install(model, kind, tile)
    memory_path.set_remat(model, remat)
    examples = testing.make_examples([length // 2, length // 3, length], 512, seed=1)
    batch = testing.packed_batch(examples, ((0, 1), (2,)), length)
    inputs = model_inputs.make_gen_model_input_fn(attention=kind)(batch)
    loss = memory_path.choose_sft_loss(TrainConfig(shards="x", loss_chunk_tokens=chunk))
    graph, params, rest = nnx.split(model, nnx.LoRAParam, ...)
    traced = jaxpr_flops.traced_flops(jax.grad(lambda p: loss(nnx.merge(graph, p, rest), **inputs)[0]), params)
    opts = flops.StepOptions(2, length, kind, tile, chunk, remat)
    return traced, flops.step_flops(flops.model_cost(model), opts, batch["segment_ids"]).total


@pytest.mark.parametrize("name,kind,chunk,remat", [
    ("tiny-gemma3", "dense", 0, False),
    ("tiny-gemma3", "dense", 128, True),  # loss chunks and the layer scan: loops XLA counts once
    ("tiny-qwen3", "dense", 0, True),
    ("tiny-gemma3", "blocked", 0, False),  # one tile per row: its loops run once, so the trace is exact
])
def test_analytic_flops_match_the_traced_step_with_loops_counted(name, kind, chunk, remat) -> None:
    traced, analytic = step_count(name, kind, chunk, remat)
    # The analytic count keeps a little the program does not: layer 0's input gradient, and the parts
    # of a rematerialised layer its backward pass never reads (measured 0.5% and 2-3%).
    assert traced == pytest.approx(analytic, rel=0.05)


def test_attention_flops_per_pair_are_the_traced_kernels() -> None:
    length, heads, head_dim = 256, 4, 16
    q = jnp.ones((1, length, heads, head_dim))
    k = jnp.ones((1, length, 1, head_dim))
    seg = jnp.ones((1, length), jnp.int32)

    def fwd_bwd(f):
        # sin: the loss needs the forward output itself, as the next layer does
        return lambda q, k, v: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), argnums=(0, 1, 2))(q, k, v)

    per_pair = length * length * heads * head_dim
    dense = lambda q, k, v: _dense(q, k, v, seg)  # noqa: E731
    blocked = lambda q, k, v: ba.blocked_attention(q, k, v, seg, tile=length)  # noqa: E731
    for kind, f in (("dense", dense), ("blocked", blocked)):
        fwd, bwd = flops.ATTENTION_PASSES[kind]
        assert jaxpr_flops.traced_flops(f, q, k, k) == fwd * per_pair
        assert jaxpr_flops.traced_flops(fwd_bwd(f), q, k, k) == (fwd + bwd) * per_pair, kind
    # Pallas kernels: FLOPs per visited (query block, key block) pair of one query head.
    from train.attention_kernels.flash_attention import flash_attention

    block = 32
    flash = lambda q, k, v: flash_attention(q, k, v, seg, block=block, style="gpu", interpret=True)  # noqa: E731
    splash = lambda q, k, v: attention.splash_attention(q, k, v, seg, block=128)  # noqa: E731
    for kind, f, b in (("flash", flash, block), ("splash", splash, 128)):
        per_block = [v / (b * b * head_dim) for _, v in jaxpr_flops.kernel_flops(fwd_bwd(f), q, k, k)]
        fwd, bwd = flops.ATTENTION_PASSES[kind]
        assert len(per_block) == 3 and per_block[0] == fwd and sum(per_block) == fwd + bwd, (kind, per_block)


def _dense(q, k, v, seg):
    b, length, n, h = q.shape
    s = jnp.einsum("btkgh,bskh->btkgs", q.reshape(b, length, 1, n, h), k).reshape(b, length, n, length)
    s = jnp.where(block_causal_mask(np.asarray(seg))[:, :, None, :], s, ba.NEG_INF)
    p = jax.nn.softmax(s, -1)
    return jnp.einsum("btkgs,bskh->btkgh", p.reshape(b, length, 1, n, length), v).reshape(b, length, n, h)


def random_rows(rng, rows=6, length=256):
    out = []
    for _ in range(rows):
        lengths = rng.integers(1, 70, size=12)
        row = np.repeat(np.arange(1, 13), lengths)[: length - int(rng.integers(0, 40))]
        out.append(np.pad(row, (0, length - len(row))))
    return np.stack(out).astype(np.int32)


def allowed(seg_row, window):
    mask = block_causal_mask(seg_row[None])[0]
    if window:
        i = np.arange(len(seg_row))
        mask &= (i[:, None] - i[None, :]) < window
    return mask


@pytest.mark.parametrize("window", [None, 40])
def test_flash_visits_exactly_the_blocks_holding_a_same_segment_causal_pair(window) -> None:
    rng = np.random.default_rng(7)
    block = 16
    for row in random_rows(rng):
        mask = allowed(row, window)
        n = len(row) // block
        needed = mask.reshape(n, block, n, block).any(axis=(1, 3)).sum()
        assert flops.attention_pairs("flash", row[None], block, window)[0] == needed * block * block


@pytest.mark.parametrize("window", [None, 40])
def test_ideal_pairs_count_the_mask(window) -> None:
    for row in random_rows(np.random.default_rng(8)):
        real = row != 0
        assert flops.ideal_pairs(row[None], window)[0] == allowed(row, window)[real].sum()


def test_splash_and_dense_pairs_ignore_the_segments() -> None:
    seg = random_rows(np.random.default_rng(9), rows=2)
    assert (flops.attention_pairs("dense", seg, 64) == 256 * 256).all()
    assert (flops.attention_pairs("splash", seg, 64) == 10 * 64 * 64).all()  # 4 query blocks: 1+2+3+4 causal
    assert (flops.attention_pairs("splash", seg, 64, window=64) == 7 * 64 * 64).all()  # the diagonal and the one before


@pytest.mark.parametrize("kind,expected", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4), ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.1), ("TPU v5 lite", 197.0),
    ("TPU v5", 459.0), ("TPU v6 lite", 918.0), ("TPU v4", 275.0), ("cpu", None), ("Tesla V100-SXM2-16GB", None),
])
def test_peak_table_by_device_kind(kind, expected) -> None:
    assert mfu.peak_tflops(kind)[0] == expected
    assert mfu.peak_tflops(kind, 100.0) == (100.0, "--peak-tflops")


def test_every_row_and_the_summary_carry_tokens_per_chip_and_mfu(tmp_path) -> None:
    cost = flops.ModelCost(layer_weights=1000, lora_weights=10, head_weights=500, heads=2, head_dim=8, windows=(None, 4))
    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    batch = {"segment_ids": seg, "loss_mask": (seg > 0).astype(np.int32)}
    model_flops = flops.model_flops(cost, seg)
    # 11 real tokens x (2 x 1000 x 2 + 2 x 10 x 3 + 2 x 500 x 2) + 12 x 8 x 2 heads x (ideal pairs: global 24, local 4 -> 20)
    assert model_flops == 11 * (4000 + 60 + 2000) + 12 * 8 * 2 * (6 + 3 + 21 + 6 + 3 + 18)
    for peak, chips in ((None, 1), (2e-9, 4)):
        recorder = MetricsRecorder(str(tmp_path / f"m{chips}.jsonl"), throughput=mfu.Throughput(cost, chips, peak), out=open("/dev/null", "w"))
        for _ in range(3):
            recorder.reset_clock()
            recorder.batch_arrived(batch)
            recorder.step_done({"loss": 1.0, "target_tokens": 9.0})
        summary = recorder.summary()
        for record in recorder.steps + [summary]:
            assert {"tokens_per_s_per_chip", "mfu"} <= set(record)
        step = recorder.steps[-1]
        assert step["tokens_per_s_per_chip"] == pytest.approx(11 / step["step_time_s"] / chips)
        if peak is None:
            assert step["mfu"] is None and summary["mfu"] is None
        else:
            assert step["mfu"] == pytest.approx(model_flops / step["step_time_s"] / (chips * peak * 1e12))
            timed = sum(s["step_time_s"] for s in recorder.steps[1:])
            assert summary["mfu"] == pytest.approx(2 * model_flops / timed / (chips * peak * 1e12))


def test_bad_peak_is_refused_with_one_line(shards, capsys) -> None:
    assert cli.main(["--shards", shards, "--model", "tiny-qwen3", "--peak-tflops", "0"]) == 2
    assert capsys.readouterr().err == "prepack train: --peak-tflops must be positive, got 0.0\n"
