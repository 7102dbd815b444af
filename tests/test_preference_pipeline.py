"""Preference pairs through the job: each pair one packing unit, its two sides adjacent segments of
one row (row format 5, docs/row_format.md), both starting with the same prompt tokens, each training
its own completion; the pair figures in the manifest; verify's pair rules, each broken once; the
tokenized set keeps pairs for --from-tokens; what pairs refuse."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipelines.options import parse_args
from prepack.format import rowformat
from prepack.text.qwen3_bpe import SPECIAL_TOKENS
from prepack.text.tokenizer import load_tokenizer
from testkit.pipeline import IN_PROCESS, read_shard_set, shard_bytes, write_jsonl
from testkit.published_schemas import SCHEMAS

L = 512
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def pack(args: list[str]):
    from pipelines.launch.job import run

    config, beam_args = parse_args(args + ["--no-progress", *IN_PROCESS])
    return run(config, beam_args)


def verify(path: str) -> tuple[int, str]:
    import io

    from apps.verify import main

    out = io.StringIO()
    return main([path], out=out, err=io.StringIO()), out.getvalue()


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def pairs_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    data = write_jsonl(str(root / "pairs.jsonl"), SCHEMAS["preference"].records)
    out = str(root / "out")
    result = pack(["--input", data, "--format", "preference", "--tokenizer", "qwen3", "--max-length", str(L), "--output", out])
    assert result.stats[L]["examples_read"] == len(SCHEMAS["preference"].records)
    return out, result


def _decoded(tok, ids) -> str:
    specials = {tok.token_to_id(t): t for t in SPECIAL_TOKENS}
    out, plain = [], []
    for tid in ids:
        if tid in specials:
            out.append(tok.decode(plain) + specials[tid])
            plain = []
        else:
            plain.append(tid)
    return "".join(out) + tok.decode(plain)


def _sides(rows):
    """(row, segment, side, ids, mask) of every segment."""
    for r, row in enumerate(rows):
        seg = row["segment_ids"]
        for k in range(1, int(seg.max()) + 1):
            at = seg == k
            yield r, k, int(row["pair_side"][at][0]), row["input_ids"][at], row["loss_mask"][at]


def test_each_pair_is_two_adjacent_segments_with_one_prompt(pairs_set, qwen3):
    out, result = pairs_set
    manifest, rows = read_shard_set(os.path.join(out, f"L{L}"))
    assert manifest.format_version == rowformat.PAIR_FORMAT_VERSION and manifest.field_order[-1] == "pair_side"
    sides = list(_sides(rows))
    assert [s[2] for s in sides] == [1, 2] * (len(sides) // 2)  # chosen, rejected, ... in every row
    completions = []
    for (r1, k1, _, ids_c, mask_c), (r2, k2, _, ids_r, mask_r) in zip(sides[::2], sides[1::2]):
        assert r1 == r2 and k2 == k1 + 1  # one row, adjacent
        p = int(np.argmax(mask_c != 0))
        assert p == int(np.argmax(mask_r != 0)) and np.array_equal(ids_c[:p], ids_r[:p])  # the same prompt
        for ids, mask in ((ids_c, mask_c), (ids_r, mask_r)):  # the rest is the completion, trained, then the turn's newline
            assert mask[p:-1].all() and mask[-1] == 0 and qwen3.decode([int(ids[-1])]) == "\n"
        completions.append((_decoded(qwen3, ids_c[p:-1]), _decoded(qwen3, ids_r[p:-1])))
    assert sorted(completions) == sorted([
        ("Red.<|im_end|>", "Green is a primary colour of paint.<|im_end|>"),
        ("4<|im_end|>", "5<|im_end|>"),
        (CALL + "<|im_end|>", "It is always sunny in Oslo.<|im_end|>"),
    ])


def test_a_ranking_file_reads_with_columns(tmp_path, qwen3):
    """{conversations: [{from, value}], chosen: {from, value}, rejected: {from, value}}, as the
    issue's example reads it."""
    data = write_jsonl(str(tmp_path / "ranking.jsonl"), SCHEMAS["ranking"].records)
    out = str(tmp_path / "out")
    pack(["--input", data, "--format", "preference", "--columns", "prompt=conversations,role=from,content=value",
          "--roles", "user=human,assistant=gpt", "--tokenizer", "qwen3", "--max-length", str(L), "--output", out])
    _, rows = read_shard_set(os.path.join(out, f"L{L}"))
    sides = list(_sides(rows))
    got = sorted(tuple(_decoded(qwen3, s[3][int(np.argmax(s[4] != 0)):-1]) for s in pair) for pair in zip(sides[::2], sides[1::2]))
    assert got == [("Hola.<|im_end|>", "Bonjour.<|im_end|>"), ("Tokyo.<|im_end|>", "Kyoto, I think.<|im_end|>")]


def test_inspect_names_each_sides_pair(pairs_set):
    import io

    from apps.inspect import main as inspect

    text = io.StringIO()
    assert inspect([os.path.join(pairs_set[0], f"L{L}"), "--rows", "1", "--no-color"], out=text) == 0
    shown = text.getvalue()
    assert ", pair 1 chosen" in shown and ", pair 1 rejected" in shown and shown.index("pair 1 chosen") < shown.index("pair 1 rejected")


def test_the_manifest_counts_pairs_and_sides(pairs_set):
    out, result = pairs_set
    stats = json.load(open(os.path.join(out, f"L{L}", "manifest.json")))["stats"]
    assert stats["pairs_read"] == stats["pairs_written"] + sum(stats["pairs_dropped"].values()) == 3
    assert stats["pairs_written"] == stats["examples_written"] and stats["pairs_dropped"] == stats["examples_dropped"]
    assert stats["chosen_tokens"] + stats["rejected_tokens"] == stats["tokens"]
    assert stats["chosen_target_tokens"] + stats["rejected_target_tokens"] == stats["target_tokens"]
    assert verify(out)[0] == 0


def test_from_tokens_packs_the_same_pairs(pairs_set, tmp_path):
    out, _ = pairs_set
    again = str(tmp_path / "again")
    pack(["--from-tokens", os.path.join(out, "tokens"), "--max-length", str(L), "--output", again])
    assert shard_bytes(os.path.join(again, f"L{L}")).keys() == shard_bytes(os.path.join(out, f"L{L}")).keys()
    assert [v for k, v in sorted(shard_bytes(os.path.join(again, f"L{L}")).items()) if k.endswith(".array_record")] == \
        [v for k, v in sorted(shard_bytes(os.path.join(out, f"L{L}")).items()) if k.endswith(".array_record")]


def test_truncate_cuts_both_completions_never_the_prompt(tmp_path, qwen3):
    from prepack.text.chat import get_chat_format, tokenize_preference_pairs
    from prepack.text.formats import get_template

    long = {"prompt": "Tell me about rivers.", "chosen": " ".join(["water"] * 60), "rejected": " ".join(["stone"] * 20)}
    data = write_jsonl(str(tmp_path / "long.jsonl"), [long])
    out = str(tmp_path / "out")
    pack(["--input", data, "--format", "preference", "--tokenizer", "qwen3", "--max-length", "64", "--overlong", "truncate",
          "--output", out])
    _, rows = read_shard_set(os.path.join(out, "L64"))
    (c, r) = [s for s in _sides(rows)]
    ids, _, ends, bounds = tokenize_preference_pairs(get_template("preference").to_conversations(long), qwen3,
                                                     get_chat_format("qwen3", qwen3))
    p, split = (int(x) for x in bounds[0])
    c1, c2 = split - p, ends[0] - split - p  # the whole completions
    budget = 64 - 2 * p  # the rule in docs/row_format.md, written out
    a = min(c1, max(budget - c2, budget // 2))
    b = min(c2, budget - a)
    assert (len(c[3]), len(r[3])) == (p + a, p + b) and len(c[3]) + len(r[3]) == 64  # a cut pair fills its row
    assert np.array_equal(c[3], ids[:p + a]) and np.array_equal(r[3], ids[split:split + p + b])  # each side's start
    stats = json.load(open(os.path.join(out, "L64", "manifest.json")))["stats"]
    assert stats["examples_truncated"] == 1 and verify(out)[0] == 0


def _rewrite(folder: str, change) -> None:
    from tests.test_verify import _rewrite_shard

    _rewrite_shard(folder, change)


def _swap_sides(rows):
    side = rows["pair_side"][0]
    real = side != 0
    side[real] = 3 - side[real]
    return 0


def _split_a_pair(rows):
    """The row's last side (a rejected one) taken out: its pair's chosen side is left alone."""
    r = int(np.argmax(rows["segment_ids"].max(axis=1)))
    last = rows["segment_ids"][r] == rows["segment_ids"][r].max()
    for name in rows:
        rows[name][r][last] = 0
    rows["input_ids"][r][last] = load_tokenizer("qwen3").pad_id  # padding as the rules want it
    return r


def _other_prompt(rows):
    seg = rows["segment_ids"][0]
    first_rejected = int(np.flatnonzero(seg == 2)[0])
    rows["input_ids"][0, first_rejected + 2] += 1  # inside the prompt: the template's tokens before the reply
    return 0


@pytest.mark.parametrize("change, rule", [
    (_swap_sides, rowformat.RULE_PAIR_SIDE),
    (_split_a_pair, rowformat.RULE_PAIR_WHOLE),
    (_other_prompt, rowformat.RULE_PAIR_PROMPT),
])
def test_verify_fails_a_broken_pairing(pairs_set, tmp_path, change, rule):
    import shutil

    out = shutil.copytree(pairs_set[0], str(tmp_path / "copy"))
    _rewrite(os.path.join(out, f"L{L}"), change)
    rc, printed = verify(out)
    assert rc == 1 and f": {rule}\n" in printed, printed


def test_pairs_refuse_pieces_and_mixing_with_single_examples(tmp_path):
    from pipelines.launch.errors import JobError
    from prepack.mixture_file import load_mixture
    from prepack.packing.mixture import MixtureError

    data = write_jsonl(str(tmp_path / "p.jsonl"), SCHEMAS["preference"].records)
    for policy in ("split", "window"):
        with pytest.raises(JobError, match=rf"^--overlong {policy} cuts examples into pieces, and a preference pair is packed "
                                           r"whole \(its two sides in one row\): use --overlong drop"):
            pack(["--input", data, "--format", "preference", "--overlong", policy, "--max-length", "64",
                  "--output", str(tmp_path / policy)])
    alpaca = write_jsonl(str(tmp_path / "a.jsonl"), [{"instruction": "x", "output": "y"}])
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: pairs, input: {data}, format: preference, weight: 1}}\n"
                   f"  - {{name: sft, input: {alpaca}, format: alpaca, weight: 1}}\n")
    with pytest.raises(MixtureError, match=r"sources \['pairs'\] are preference pairs and \['sft'\] are not; a set holds "
                                           r"one kind \(pack them apart\)$"):
        load_mixture(str(mix))


def test_a_pair_the_chat_format_cannot_lay_out_is_a_dead_letter(tmp_path):
    """Gemma 3's format has no tool markup: the pair whose chosen reply is a tool call is a bad record
    with its own reason, and the other pairs are packed. (The chat format's error counted sides, and
    the job took that index for a pair's: the job failed with a traceback instead.)"""
    from pipelines.launch.errors import JobError

    data = write_jsonl(str(tmp_path / "pairs.jsonl"), SCHEMAS["preference"].records)
    out = str(tmp_path / "out")
    args = ["--input", data, "--format", "preference", "--max-length", str(L), "--output", out]
    with pytest.raises(JobError, match=r"^1 of 3 examples read are bad records \(33\.33%, more than --max-bad-fraction 0\): "
                                       r"tools_not_supported 1 \(Gemma 3 has no tool tokens"):
        pack(args)
    stats = pack(args + ["--max-bad-fraction", "0.5"]).stats[L]
    assert stats["pairs_read"] == 3 and stats["pairs_written"] == 2
    dead = [json.loads(line) for line in open(os.path.join(out, f"L{L}", "dead_letter.jsonl"))]
    assert [(d["reason"], d["example_id"], d["source"]["line"]) for d in dead] == [("tools_not_supported", "0/pairs.jsonl/2", 3)]
    assert verify(out)[0] == 0


def test_the_shipped_preference_sample_is_its_generators_and_every_record_a_pair(tmp_path, monkeypatch):
    """prepack/sample_data/sample_preference.jsonl (the README's DPO walkthrough): what generate.py
    writes, byte for byte, and each of its 200 records one pair with differing sides (no dead letter)."""
    import importlib.util

    from prepack.text.formats import get_template

    sample_dir = os.path.join(os.path.dirname(rowformat.__file__), "..", "sample_data")
    spec = importlib.util.spec_from_file_location("generate_samples", os.path.join(sample_dir, "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    monkeypatch.setattr(generate, "PREFERENCE_OUT", tmp_path / "sample_preference.jsonl")
    generate.write_preference()
    shipped = open(os.path.join(sample_dir, "sample_preference.jsonl"), "rb").read()
    assert (tmp_path / "sample_preference.jsonl").read_bytes() == shipped
    template = get_template("preference")
    records = [json.loads(line) for line in shipped.decode().splitlines()]
    assert len(records) == 200 and all(len(template.to_conversations(r)) == 1 for r in records)
