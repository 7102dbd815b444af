"""Host CPU per batch: reading pre-packed shards vs tokenizing and packing online.

The same examples (the real SFT samples in $PREPACK_BENCH_DATA, benchmarks/data.py, tokenized by each family:
Gemma3 with the gemma chat format, Qwen3 with the embedded qwen3 tokenizer and its ChatML)
feed both sides:
- pre-packed: tokenized and BFD-packed once, offline (not timed), written as a
  shard set; timed: loaders.make_dataset reading and decoding [B, L] batches.
- online: what online packers (MaxText, Grain's examples) do on the training host:
  template + tokenize each example in a Grain map, then
  grain.experimental.FirstFitPackIterDataset (num_packing_bins = B), then batch.
- online, packing only: the same packer over already-tokenized examples,
  to show how the online cost splits between tokenizing and packing.

CPU is time.process_time() (all threads of this process) over the timed
batches, after warm-up. The pre-packed side runs three ways in the same run:
read_threads=0 (no read thread: the floor), make_dataset's default (threads
chosen by the path: 1 on local disk) and read_threads=16 (the old default);
the online side runs with no read thread. rows/s per core = rows / CPU seconds.
A read thread may read ahead up to `prefetch` batches that are never consumed;
with prefetch=16 and 200+ timed batches that bounds the overcount. The shard
files sit in the page cache, so storage latency is not part of this; it is the
host's CPU cost per row that the numbers compare.
Without prepack.text.tokenizer/templates, synthetic rows and examples are used, and
the online side then measures packing only.

    python -m benchmarks.bench_loader                 # both shapes, both tokenizers, markdown table
    python -m benchmarks.bench_loader --shapes 8x2048 --batches 300
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

import grain

import loaders
from testkit import plans
from prepack.format import rowformat
from testkit.shard_sets import build_shard_set

from benchmarks.data import DATA_DIR
# Tokenizer spec -> its chat format.
FAMILIES = {"gemma3": "gemma", "qwen3": "qwen3"}
# file -> (template, template options)
SOURCES = {
    "alpaca.jsonl": ("alpaca", {}),
    "oasst1.jsonl": ("prompt_response", {}),
    "oasst1_chat.jsonl": ("chat", {}),
    "opus_en_fr.jsonl": ("translation", {"source_lang": "en", "target_lang": "fr"}),
}


# ----------------------------------------------------------------------------- inputs


class RealExamples:
    """Records from the real samples (benchmarks/data.py) with their template, and a per-record tokenizing function."""

    def __init__(self, data_dir: str, tokenizer_spec: str = "gemma3"):
        from prepack.text import chat, formats
        from prepack.text.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_spec)
        self.chat_format = chat.get_chat_format(FAMILIES[tokenizer_spec], self.tokenizer)
        self.records: list[tuple[str, dict]] = []
        self.templates = {}
        for name, (template, options) in SOURCES.items():
            path = os.path.join(data_dir, name)
            if not os.path.exists(path):
                continue
            self.templates[name] = formats.get_template(template, **options)
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    # One item per conversation, so the online map is one-to-one.
                    n = len(self.templates[name].to_conversations(record))
                    self.records += [(name, record, k) for k in range(n)]
        if not self.records:
            raise FileNotFoundError(f"no sample data in {data_dir}")
        self.description = (f"{len(self.records):,} real examples ({', '.join(self.templates)}), {tokenizer_spec} tokenizer, "
                            f"{self.chat_format.name} chat format")

    def tokenize(self, item: tuple[str, dict, int]) -> tuple[np.ndarray, np.ndarray]:
        """One example: template, chat format, tokenize (what an online pipeline does per example)."""
        from prepack.text import chat

        name, record, k = item
        conv = self.templates[name].to_conversations(record)[k]
        (example,) = chat.tokenize_conversations([conv], self.tokenizer, self.chat_format)
        return example.input_ids, example.loss_mask

    def identity(self) -> dict:
        return self.tokenizer.identity()


class SyntheticExamples:
    """Fallback: lognormal lengths like the real mix, random ids; 'tokenizing' is a lookup."""

    def __init__(self, n: int = 10_000, seed: int = 0):
        rng = np.random.default_rng(seed)
        lengths = np.clip(rng.lognormal(4.2, 0.9, n), 8, 4096).astype(int)
        self.records = [(str(i), {"ids": rng.integers(3, 262_144, k, dtype=np.int32)}, 0) for i, k in enumerate(lengths)]
        self.description = f"{n:,} synthetic examples (no tokenizer: online side = packing only)"

    def tokenize(self, item):
        ids = item[1]["ids"]
        mask = np.zeros(len(ids), np.uint8)
        mask[len(ids) // 2 :] = 1
        return ids, mask

    def identity(self) -> dict:
        return {"name": "synthetic", "vocab_size": 262_144, "bos_id": 2, "eos_id": 1, "pad_id": 0, "special_ids": {}, "vocab_hash": "-"}


def truncate(example: tuple[np.ndarray, np.ndarray], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = example
    return ids[:max_length], mask[:max_length]


# ----------------------------------------------------------------------------- pipelines


def build_prepacked(
    tokenized: Sequence[tuple[np.ndarray, np.ndarray]], max_length: int, folder: str, identity: dict, min_rows: int
) -> tuple[int, int]:
    """Offline side, not timed: BFD-pack the tokenized examples and write a shard set.

    The packed rows are repeated up to min_rows: Grain's index shuffle walks cycles
    on a fixed minimum domain, so on a set of a few hundred rows it alone costs
    ~80 us per row (5 us at 10k rows, 3 us at 64k); real shard sets are large.
    Returns (distinct packed rows, rows written).
    """
    examples = [truncate(e, max_length) for e in tokenized]
    plan = plans.pack_best_fit_decreasing([len(e[0]) for e in examples], max_length)
    rows = [rowformat.build_row([rowformat.Segment(*examples[i]) for i in row], max_length) for row in plan]
    written = rows * max(1, -(-min_rows // len(rows)))
    build_shard_set(folder, rows=written, num_shards=8, max_length=max_length, tokenizer=identity)
    return len(rows), len(written)


def prepacked_batches(folder: str, batch_size: int, read_threads: int | None) -> Iterator[dict]:
    ds = loaders.make_dataset(folder, batch_size, seed=0, shard_index=0, shard_count=1, read_threads=read_threads, prefetch=16)
    return iter(ds)


def _pack_and_batch(ds: grain.IterDataset, batch_size: int, max_length: int) -> Iterator[dict]:
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"input_ids": max_length, "loss_mask": max_length}, num_packing_bins=batch_size, seed=0
    )
    return iter(ds.batch(batch_size, drop_remainder=True))


def online_batches(examples, batch_size: int, max_length: int) -> Iterator[dict]:
    """Online side: template + tokenize each example in a map, first-fit pack, batch."""

    def tokenize(item):
        ids, mask = truncate(examples.tokenize(item), max_length)
        return {"input_ids": ids, "loss_mask": mask.astype(np.int32)}

    ds = grain.MapDataset.source(examples.records).shuffle(seed=0).repeat(None).map(tokenize)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return _pack_and_batch(ds, batch_size, max_length)


def online_packing_only(tokenized: Sequence[tuple[np.ndarray, np.ndarray]], batch_size: int, max_length: int) -> Iterator[dict]:
    items = [{"input_ids": ids, "loss_mask": mask.astype(np.int32)} for ids, mask in (truncate(e, max_length) for e in tokenized)]
    ds = grain.MapDataset.source(items).shuffle(seed=0).repeat(None)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return _pack_and_batch(ds, batch_size, max_length)


# ----------------------------------------------------------------------------- timing


def measure(make: Callable[[], Iterator[dict]], batches: int, warmup: int) -> dict:
    it = make()
    for _ in range(warmup):
        next(it)
    tokens = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(batches):
        batch = next(it)
        tokens += int(np.count_nonzero(batch["input_ids_segment_ids"] if "input_ids_segment_ids" in batch else batch["segment_ids"]))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if hasattr(it, "close"):
        it.close()
    rows = batches * len(batch["input_ids"])
    return {
        "cpu_ms_per_batch": 1e3 * cpu / batches,
        "cpu_us_per_row": 1e6 * cpu / rows,
        "rows_per_cpu_s": rows / cpu,
        "rows_per_wall_s": rows / wall,
        "density": tokens / (rows * batch["input_ids"].shape[1]),
        "cpu_ns_per_token": 1e9 * cpu / max(tokens, 1),
    }


def parse_shapes(text: Sequence[str]) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.lower().split("x")) for s in text]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8x2048", "16x512"], help="BxL shapes (default 8x2048 16x512)")
    p.add_argument("--batches", type=int, default=200, help="timed pre-packed batches per shape")
    p.add_argument("--online-batches", type=int, default=30, help="timed online batches per shape")
    p.add_argument("--min-rows", type=int, default=16_384, help="repeat packed rows up to this many in the shard set")
    p.add_argument("--synthetic", action="store_true", help="use synthetic examples even if the tokenizer is available")
    p.add_argument("--tokenizers", nargs="+", default=list(FAMILIES), choices=list(FAMILIES),
                   help="tokenizer families for the real examples (default: both, on the same records)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    inputs = []
    for spec in args.tokenizers:
        try:
            if args.synthetic:
                raise ImportError("--synthetic")
            examples = RealExamples(DATA_DIR, spec)
        except (ImportError, FileNotFoundError) as e:
            print(f"note: {e}; using synthetic examples", file=sys.stderr)
            inputs = [(SyntheticExamples(), "synthetic")]
            break
        inputs.append((examples, spec))

    results = []
    for examples, family in inputs:
        t0 = time.process_time()
        tokenized = [examples.tokenize(item) for item in examples.records]
        tok_cpu = time.process_time() - t0
        n_tokens = sum(len(e[0]) for e in tokenized)
        print(f"inputs: {examples.description}; {len(tokenized):,} examples, {n_tokens:,} tokens; "
              f"per-example tokenizing {1e6 * tok_cpu / n_tokens:.2f} us/token", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
            for batch_size, max_length in parse_shapes(args.shapes):
                folder = os.path.join(tmp, f"L{max_length}")
                n_rows, n_written = build_prepacked(tokenized, max_length, folder, examples.identity(), args.min_rows)
                pre = measure(lambda: prepacked_batches(folder, batch_size, 0), args.batches, warmup=5)
                pre_default = measure(lambda: prepacked_batches(folder, batch_size, None), args.batches, warmup=20)
                pre_threads = measure(lambda: prepacked_batches(folder, batch_size, 16), args.batches, warmup=20)
                online = measure(lambda: online_batches(examples, batch_size, max_length), args.online_batches, warmup=2)
                pack_only = measure(lambda: online_packing_only(tokenized, batch_size, max_length), args.online_batches, warmup=2)
                results.append({
                    "tokenizer": family, "description": examples.description,
                    "shape": f"{batch_size}x{max_length}", "packed_rows": n_rows, "rows_in_shard_set": n_written,
                    "prepacked": pre, "prepacked_default": pre_default, "prepacked_16_threads": pre_threads,
                    "online": online, "online_packing_only": pack_only,
                    "ratio_cpu_per_row": online["cpu_us_per_row"] / pre_default["cpu_us_per_row"],
                    "default_vs_zero_threads": pre_default["cpu_us_per_row"] / pre["cpu_us_per_row"],
                })
                print(f"done {family} {batch_size}x{max_length}", file=sys.stderr)

    cpu = platform.processor() or platform.machine()
    descriptions = "; ".join(dict.fromkeys(r["description"] for r in results))
    print(f"\nInputs: {descriptions}. Host: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
          f"grain {getattr(grain, '__version__', '?')}.\n")
    print("| tokenizer | B×L | pipeline | host CPU ms/batch | CPU µs/row | rows/s per core | rows/s (wall) | row density |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        for key, label in (("prepacked", "pre-packed shards (read_threads=0)"), ("prepacked_default", "pre-packed shards (default: 1 thread on local disk)"),
                           ("prepacked_16_threads", "pre-packed shards (read_threads=16)"),
                           ("online", "online: tokenize + FirstFitPack"), ("online_packing_only", "online: FirstFitPack only (pre-tokenized)")):
            m = r[key]
            print(f"| {r['tokenizer']} | {r['shape']} | {label} | {m['cpu_ms_per_batch']:.3f} | {m['cpu_us_per_row']:.1f} | {m['rows_per_cpu_s']:,.0f} | "
                  f"{m['rows_per_wall_s']:,.0f} | {100 * m['density']:.1f}% |")
    print()
    for r in results:
        print(f"- {r['tokenizer']} {r['shape']}: shard set of {r['rows_in_shard_set']:,} rows ({r['packed_rows']:,} distinct BFD-packed rows, repeated).")
    for r in results:
        print(f"- {r['tokenizer']} {r['shape']}: online uses {r['ratio_cpu_per_row']:.0f}x the host CPU per row of pre-packed shards at the default "
              f"(goal >= 50x); the default costs {r['default_vs_zero_threads']:.2f}x the CPU per row of read_threads=0 (goal <= 1.3x); "
              f"it reads {r['prepacked_default']['rows_per_cpu_s']:,.0f} rows/s per core (goal >= 10k at L2048).")
    print("\nCommand: `" + " ".join(["python -m benchmarks.bench_loader", *(argv if argv is not None else sys.argv[1:])]) + "`")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
