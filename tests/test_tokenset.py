"""The tokenized set's record format and manifest (prepack/format/tokenset.py): no Beam."""

from __future__ import annotations

import numpy as np
import pytest

from prepack.format import tokenset
from prepack.packing.accounting import Tally
from prepack.format.manifest import ShardInfo


def _batch(seed: int, n: int = 60, vocab: int = 262_144, mask_values: int = 2):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 45, n)
    lens[:3] = (0, 1, 8)  # empty, one token, exactly one mask byte
    ids = rng.integers(0, vocab, int(lens.sum())).astype("<i4")
    mask = rng.integers(0, mask_values, int(lens.sum())).astype(np.uint8)
    eids = [f"0/part é {i}/{i * 7}" for i in range(n)]
    locs = [(i % 3, i * 11, i * 11 + 1, i % 2) for i in range(n)]
    return eids, locs, lens, ids, mask


def _split(lens, flat):
    ends = np.cumsum(lens)
    return [flat[e - n : e] for n, e in zip(lens.tolist(), ends.tolist())]


@pytest.mark.parametrize("vocab,mask_values", [(262_144, 2), (1 << 25, 2), (1000, 3)])
def test_batch_encoding_is_the_per_example_encoding_and_decodes_back(vocab, mask_values):
    eids, locs, lens, ids, mask = _batch(seed=vocab % 97, vocab=vocab, mask_values=mask_values)
    records = tokenset.encode_batch(eids, locs, lens, ids, mask)
    per_ids, per_mask = _split(lens, ids), _split(lens, mask)
    if vocab < 1 << 24 and mask_values == 2:
        # The fast encoder writes exactly the reference bytes when the batch is 24-bit / 0-1.
        assert records == [tokenset.encode_example(e, loc, i, m) for e, loc, i, m in zip(eids, locs, per_ids, per_mask)]
    for record, e, loc, i, m in zip(records, eids, locs, per_ids, per_mask):
        got = tokenset.decode_example(record)
        assert got[0] == e and got[1] == loc and np.array_equal(got[2], i) and np.array_equal(got[3], m)
    decoded = tokenset.decode_batch(records)
    assert decoded.example_ids == eids and decoded.locs == locs
    assert np.array_equal(decoded.lens, lens) and np.array_equal(decoded.ids, ids) and np.array_equal(decoded.mask, mask)


def test_records_are_compact():
    eids, locs, lens, ids, mask = _batch(seed=1)
    records = tokenset.encode_batch(eids, locs, lens, ids, mask)
    overhead = sum(len(r) for r in records) - 3 * int(lens.sum()) - sum(len(e.encode()) for e in eids)
    # 3 bytes per id, a bit per mask value; the rest is a fixed header per example.
    assert overhead <= len(records) * (31 + 1 + 9 + 1) + int(lens.sum()) // 8


def test_damaged_record_is_refused_with_its_example_id():
    eids, locs, lens, ids, mask = _batch(seed=2, n=5)
    record = tokenset.encode_batch(eids, locs, lens, ids, mask)[4]
    with pytest.raises(tokenset.TokenSetError, match="record of '0/part é 4/28' is damaged"):
        tokenset.decode_example(record[:-1])
    with pytest.raises(tokenset.TokenSetError, match="not a tokenized-set record of version 1"):
        tokenset.decode_batch([b"\x07" + record[1:]])


def _manifest(**choices) -> tokenset.TokenSetManifest:
    return tokenset.TokenSetManifest(
        shards=[ShardInfo("tokens-a.array_record", 3, 100, "0" * 64)], num_examples=3, tokens=30, target_tokens=10,
        choices={"inputs": ["in.jsonl"], "format": "alpaca", "template_options": {}, "chat_format": "auto",
                 "tokenizer": "gemma3", **choices},
        tokenizer={"name": "gemma3", "pad_id": 0}, template={}, inputs=[], stats={},
        job={"tasks": [], "fingerprints": [], "tally": Tally().to_json(), "est_records": 3},
    )


def test_manifest_round_trip_and_refusals():
    manifest = _manifest()
    assert tokenset.TokenSetManifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(tokenset.TokenSetError, match="format_version 2 is not supported"):
        tokenset.TokenSetManifest.from_json(manifest.to_json().replace('"format_version": 1', '"format_version": 2'))
    with pytest.raises(tokenset.TokenSetError, match="not a tokenized set's manifest"):
        tokenset.TokenSetManifest.from_json('{"format_version": 1, "max_length": 512}')
    with pytest.raises(tokenset.TokenSetError, match="add up to 3, not num_examples 4"):
        tokenset.TokenSetManifest.from_json(manifest.to_json().replace('"num_examples": 3', '"num_examples": 4'))


def test_mismatch_names_the_choice():
    manifest = _manifest()
    assert manifest.mismatch({}) is None
    assert manifest.mismatch({"format": "alpaca", "tokenizer": "gemma3", "inputs": ("in.jsonl",)}) is None
    assert manifest.mismatch({"tokenizer": "hf:Qwen/Qwen2.5-0.5B"}) == \
        "--tokenizer hf:Qwen/Qwen2.5-0.5B differs from the tokenized set's gemma3"
    assert manifest.mismatch({"inputs": ("other.jsonl",)}) == "--input other.jsonl differs from the tokenized set's in.jsonl"
    assert manifest.mismatch({"template_options": (("target_lang", "de"),)}) == \
        'template options {"target_lang": "de"} differs from the tokenized set\'s {}'
