"""A train step too large for memory ends in one line naming the batch, L and model, with a smaller batch to try.

The failure is a real one: XLA's own RESOURCE_EXHAUSTED JaxRuntimeError, from an allocation of
4 TiB that fails, raised inside Tunix's loop as step 1's batch goes to the device (the batch's
device transfer is wrapped where the trainer looks it up). Not from inside the jitted step: on
CPU, jax 0.10.2 runs a step of this size asynchronously, and an output it cannot allocate there
never completes, so the first fetch of the step's metrics waited forever (this test hung the
suite) instead of raising; an accelerator reports the error at dispatch, as here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from prepack.format import rowformat
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
from testkit.train_batches import learnable_segments
from train import cli
from train.measurement import out_of_memory

VOCAB = 64
MAX_LENGTH = 32
TOO_MANY_BYTES = 2**42  # 4 TiB: more than any machine this runs on can allocate at once


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("oom") / "L32")
    rows = [rowformat.build_row([s], MAX_LENGTH) for s in learnable_segments(8, VOCAB, seed=3)]
    build_shard_set(path, rows=rows, tokenizer={**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": VOCAB}, num_shards=1)
    return path


@pytest.fixture
def step_too_large(monkeypatch) -> None:
    from train.step import model_inputs

    real = model_inputs.device_fields

    def fields_after_a_failed_allocation(batch):
        jnp.zeros((TOO_MANY_BYTES,), jnp.uint8).block_until_ready()  # raises XLA's RESOURCE_EXHAUSTED
        return real(batch)

    monkeypatch.setattr(model_inputs, "device_fields", fields_after_a_failed_allocation)


def test_xla_allocation_failure_is_recognised() -> None:
    with pytest.raises(jax.errors.JaxRuntimeError) as raised:
        jnp.zeros((TOO_MANY_BYTES,), jnp.uint8).block_until_ready()
    assert out_of_memory.is_out_of_memory(raised.value)
    assert not out_of_memory.is_out_of_memory(ValueError("RESOURCE_EXHAUSTED"))  # only XLA's own error


@pytest.mark.slow  # trains a real (tiny) model: see pytest.ini
def test_a_step_that_does_not_fit_is_one_line_with_a_smaller_batch(shards, step_too_large, capsys) -> None:
    rc = cli.main(["--shards", shards, "--model", "tiny", "--lora-rank", "4", "--batch-size", "4", "--steps", "2",
                   "--read-threads", "1", "--log-every", "0", "--loss-chunk-tokens", "0", "--remat", "none"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err and "RESOURCE_EXHAUSTED" not in err
    assert [line for line in err.splitlines() if line.startswith("prepack train:")] == [
        "prepack train: out of memory: a train step of --batch-size 4 rows x L 32 (128 tokens) on --model tiny "
        "does not fit (XLA asked for 4,096.0 GiB at once); try --batch-size 2 (check it first with "
        "--plan-memory --batch-size 2), or --remat layer"
    ]


def test_the_smaller_batch_divides_the_mesh_and_a_batch_of_one_asks_for_other_changes() -> None:
    assert out_of_memory.smaller_batch_size(16) == 8
    assert out_of_memory.smaller_batch_size(12, batch_divisor=4) == 4  # half is 6; fsdp=4 needs a multiple of 4
    assert out_of_memory.smaller_batch_size(4, batch_divisor=4) is None
    assert out_of_memory.out_of_memory_message(1, 4096, "gemma3-1b", remat_on=True) == (
        "out of memory: a train step of --batch-size 1 rows x L 4096 (4,096 tokens) on --model gemma3-1b does not fit; "
        "--batch-size is already 1: try a smaller --loss-chunk-tokens, or shards packed for a shorter L "
        "(prepack pack --max-length 2048)"
    )
