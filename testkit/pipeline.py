"""Small inputs for the packing-job tests, written by the tests themselves.

Every format the job reads (alpaca, translation in both shapes, oasst1 message
tables, chat, prompt_response) in every container (JSONL, JSON array, Parquet,
a save_to_disk folder, a locally built TFDS dataset), plus helpers that run the
job on the in-process runner and read published shard sets back.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from prepack.format import rowformat
from prepack.format.manifest import Manifest
from testkit.reference import split_segments

# In-process Beam runner: no worker start-up cost, DoFns still pickled and bundled.
IN_PROCESS = ["--runner=FnApiRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
TWO_PROCESSES = ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2"]

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def words(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n))


def alpaca_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Lengths from ~20 to ~250 Gemma tokens, so L=64/128 packs, truncates and drops."""
    out = []
    for i in range(n):
        k = seed * 1000 + i
        out.append({
            "instruction": f"Task {k}: " + words(2 + k % 9, k),
            "input": words(k % 5 * 3, k + 1) if k % 3 else "",
            "output": words(2 + (k * 37) % 40, k + 2),
        })
    return out


def write_jsonl(path: str, records: Sequence[Any], extra_lines: Sequence[bytes] = ()) -> str:
    with open(path, "wb") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n")
        for line in extra_lines:
            f.write(line + b"\n")
    return path


def write_json(path: str, records: Sequence[Any]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(list(records), f, ensure_ascii=False)
    return path


def write_parquet(path: str, records: Sequence[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(records)), path)
    return path


def translation_records() -> list[dict]:
    """Both shapes: flat {en, de} and OPUS-100's {"translation": {en, de}}."""
    flat = [{"en": f"The {w} is here {i}.", "de": f"Das {w} ist hier {i}."} for i, w in enumerate(WORDS[:8])]
    nested = [{"translation": {"en": f"I see the {w}.", "de": f"Ich sehe das {w}."}} for w in WORDS[8:14]]
    return flat + nested


def oasst1_messages() -> list[dict]:
    """Three trees: one English tree with 3 assistant replies, one German (filtered),
    one with a message of an unknown role (a bad record)."""
    def msg(mid, parent, tree, role, text, lang="en", review=True, deleted=False):
        return {"message_id": mid, "parent_id": parent, "message_tree_id": tree, "role": role, "text": text,
                "lang": lang, "review_result": review, "deleted": deleted}

    return [
        msg("a1", None, "A", "prompter", "What is a " + words(5, 1) + "?"),
        msg("a2", "a1", "A", "assistant", "It is " + words(20, 2) + "."),
        msg("a3", "a1", "A", "assistant", "Another answer: " + words(12, 3)),
        msg("a4", "a2", "A", "prompter", "Tell me more about " + words(4, 4)),
        msg("a5", "a4", "A", "assistant", "More: " + words(30, 5)),
        msg("b1", None, "B", "prompter", "Was ist das?", lang="de"),
        msg("b2", "b1", "B", "assistant", "Das ist gut.", lang="de"),
        msg("c1", None, "C", "prompter", "Hello " + words(3, 6)),
        msg("c2", "c1", "C", "robot", "beep"),
        msg("c3", "c1", "C", "assistant", "Hi! " + words(8, 7)),
    ]


def chat_records(n: int = 12) -> list[dict]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": "Q: " + words(3 + i % 4, i)},
                    {"role": "assistant", "content": "A: " + words(5 + i * 3 % 17, i + 1)}]
        if i % 3 == 0:
            messages = [{"role": "system", "content": "Be brief."}] + messages + [
                {"role": "user", "content": "And then?"}, {"role": "assistant", "content": words(4, i + 2)}]
        out.append({"messages": messages})
    return out


def save_chat_dataset(folder: str, records: Sequence[dict]) -> str:
    import datasets

    datasets.Dataset.from_list(list(records)).save_to_disk(folder)
    return folder


def prompt_response_records(n: int = 15) -> list[dict[str, str]]:
    return [{"prompt": "Say " + words(2 + i % 6, i), "response": words(3 + i * 5 % 23, i + 9)} for i in range(n)]


def build_tfds_dataset(data_dir: str, records: Sequence[dict[str, str]]) -> str:
    """A tiny array_record TFDS dataset 'tiny_prompt_response' built without TensorFlow."""
    import tensorflow_datasets as tfds

    class TinyPromptResponse(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict({"prompt": tfds.features.Text(), "response": tfds.features.Text()}),
            )

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i, r in enumerate(records):
                yield i, r

    TinyPromptResponse(data_dir=data_dir, file_format="array_record").download_and_prepare()
    return "tiny_prompt_response"


# ----------------------------------------------------------------------------- reading results


def read_shard_set(folder: str) -> tuple[Manifest, list[dict[str, np.ndarray]]]:
    from array_record.python.array_record_module import ArrayRecordReader

    with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as f:
        manifest = Manifest.from_json(f.read())
    rows = []
    for shard in manifest.shards:
        reader = ArrayRecordReader(os.path.join(folder, shard.path))
        try:
            assert "group_size:1" in reader.writer_options_string()
            rows += [rowformat.decode_row(r, manifest.max_length, manifest.field_order) for r in reader.read_all()]
        finally:
            reader.close()
    return manifest, rows


def segment_key(ids: Sequence[int], mask: Sequence[int]) -> tuple:
    """How an example is recognised in a row: its ids and its loss mask after the first token
    (the row builder zeroes the first token's loss)."""
    return (tuple(int(i) for i in ids), tuple(int(m) for m in mask[1:]))


def segments_in(rows: Sequence[dict[str, np.ndarray]]) -> Counter:
    found: Counter = Counter()
    for row in rows:
        for seg in split_segments(row):
            assert int(seg.loss_mask[0]) == 0
            found[segment_key(seg.input_ids, seg.loss_mask)] += 1
    return found


def tokenized(convs: Sequence[Any]) -> list[Any]:
    from prepack.text.chat import tokenize_conversations
    from prepack.text.tokenizer import load_tokenizer

    tok = load_tokenizer("gemma3")
    return tokenize_conversations(list(convs), tok, "auto")


def shard_bytes(folder: str) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))
            if name.endswith(".array_record") or name.endswith(".jsonl")}
