"""The README's code runs as written, so it cannot drift from the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, synthetic_row

REPO = Path(__file__).resolve().parent.parent
SETTINGS = re.compile(r'^SHARDS, BATCH_SIZE, STEPS, CKPT = "[^"]+", \d+, \d+, "[^"]+"$')
VOCAB, MAX_LENGTH, ROWS, BATCH = 128, 32, 12, 2


def readme_block(heading: str) -> str:
    """The first ```python block under `heading` in README.md."""
    text = (REPO / "README.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_own_trainer(settings: str, block: str) -> dict:
    """Runs the README block with the test's settings line and a fresh tiny LoRA model as `lora_model`."""
    from train.model import models

    built = models.build_model("tiny-qwen3", vocab_size=VOCAB, seed=0)
    scope = {"lora_model": models.apply_lora(built.model, built.spec, rank=4)}
    first, rest = block.split("\n", 1)
    assert SETTINGS.match(first), f"the block must start with its settings line, got {first!r}"
    exec(compile(settings + "\n" + rest, "README.md", "exec"), scope)  # noqa: S102
    return scope


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_own_tunix_trainer_section_trains_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    build_shard_set("OUT/L32", rows=[synthetic_row(r, MAX_LENGTH, rng, vocab_size=VOCAB) for r in range(ROWS)],
                    tokenizer={**TEST_TOKENIZER, "vocab_size": VOCAB})
    block = readme_block("## Your own Tunix trainer")

    first = run_own_trainer(f'SHARDS, BATCH_SIZE, STEPS, CKPT = "OUT/L32", {BATCH}, 2, "ckpt"', block)
    assert first["trainer"].train_steps == 2
    lora_b = [v for p, v in nnx.iter_graph(first["lora_model"]) if isinstance(v, nnx.LoRAParam) and "lora_b" in str(p[-1])]
    assert lora_b and any(float(np.abs(np.asarray(v[...])).max()) > 0 for v in lora_b)  # B starts at zero: it trained

    # A second process-equivalent run: Tunix restores step 2, the loader seeks to batch 3.
    from train.checkpointing import resume

    streams = []

    class Recorded(resume.ResumableStream):
        def __init__(self, iterator, **kwargs):
            streams.append(kwargs)
            super().__init__(iterator, **kwargs)

    monkeypatch.setattr(resume, "ResumableStream", Recorded)
    second = run_own_trainer(f'SHARDS, BATCH_SIZE, STEPS, CKPT = "OUT/L32", {BATCH}, 4, "ckpt"', block)
    assert second["trainer"].train_steps == 4
    assert streams == [{"consumed": 2, "placeholders": 2}]  # resumed by seeking, not by re-reading

    import loaders
    from train.checkpointing.checkpoints import CheckpointDir

    fresh = iter(loaders.make_dataset("OUT/L32", batch_size=BATCH, seed=0))
    for _ in range(4):
        next(fresh)
    ckpt = CheckpointDir("ckpt")
    assert ckpt.load_data_state(4) == json.loads(json.dumps(fresh.get_state()))  # saved with Tunix's step 4
    assert ckpt.load_data_state(2) is not None and sorted(ckpt._read_data()["states"]) == ["2", "4"]
