"""The packing job's CPU with a 3-source mixture against the same examples packed as one source.

Three real formats from $PREPACK_BENCH_DATA (Alpaca as `alpaca`, OASST1 prompt/response pairs as
`chat`, OPUS-100 en-fr as `translation`), each repeated to --examples / 3 records, into a temp
folder (never the repository), on the default local runner (FnApiRunner, multi-processing, all
cores):

1. the mixture: `--mixture` over the three files, weight_of examples, weights equal to the
   sources' kept examples at the one max length (from a warm-up run) and max_repeats 1, so every
   kept example is written (nothing down-sampled or repeated) and the output holds the same
   examples as the baseline, with `source_ids`;
2. the baseline: the same conversations written as one `chat` JSONL file (each source's
   template applied first, turns kept verbatim) packed with `--input --format chat`.

Reported: CPU (launcher + workers) and wall of each run, the ratio (1) / (2), and the check
that both tokenized and wrote the same number of examples and tokens.

    python -m benchmarks.bench_mixture --examples 30000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

from benchmarks.bench_pack_job import DATA, make_workdir, repeat_to

SOURCES = [  # name, file, format, template options
    ("alpaca", "alpaca.jsonl", "alpaca", {}),
    ("chat", "oasst1_chat.jsonl", "chat", {}),
    ("fr", "opus_en_fr.jsonl", "translation", {"source_lang": "en", "target_lang": "fr"}),
]


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def timed(args: list[str], beam_args: list[str]) -> dict:
    from pipelines.launch.job import run
    from pipelines.options import parse_args

    config, beam = parse_args(args + ["--no-progress", "--overwrite", "--no-tokens"] + beam_args)
    before = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    started = time.perf_counter()
    result = run(config, beam)
    wall = time.perf_counter() - started
    after = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    cpu = sum(_cpu(a) - _cpu(b) for a, b in zip(after, before))
    stats = {L: {k: s[k] for k in ("examples_written", "tokens", "rows")} for L, s in result.stats.items()}
    return {"wall": wall, "cpu": cpu, "tokenized": result.metrics.get("tokens_tokenized", 0),
            "mix_s": result.metrics.get("time_us_mix", 0) / 1e6, "stats": stats}


def as_chat(path: str, fmt: str, options: dict, out) -> int:
    """Each record's conversations as `chat` records (the same turns, so the same tokens)."""
    from prepack.text.formats import get_template

    template = get_template(fmt, **options)
    n = 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            for conv in template.to_conversations(json.loads(line)):
                role = lambda t: t.role.value if hasattr(t.role, "value") else t.role  # noqa: E731
                assistant = tuple(i for i, t in enumerate(conv.turns) if role(t) == "assistant")
                if conv.loss_turns is not None and tuple(conv.loss_turns) != assistant:
                    raise SystemExit(f"{fmt}: a conversation with chosen loss turns has no exact chat record")
                out.write(json.dumps({"messages": [{"role": t.role.value if hasattr(t.role, "value") else t.role,
                                                    "content": t.content} for t in conv.turns]}) + "\n")
                n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("PREPACK_BENCH_DATA", DATA))
    ap.add_argument("--examples", type=int, default=30_000, help="records in all (a third per source)")
    ap.add_argument("--max-length", type=int, default=1024,
                    help="one max length: weights set to each source's kept examples there keep every example")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = make_workdir(args.workdir, "prepack-bench-mix-")
    beam_args = ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", f"--direct_num_workers={os.cpu_count()}"]
    lengths = [str(args.max_length)]
    lines = ["weight_of: examples", "max_repeats: 1", "sources:"]
    chat_path = os.path.join(work, "one_source.jsonl")
    with open(chat_path, "w") as chat:
        for name, file, fmt, options in SOURCES:
            path = os.path.join(work, file)
            count = repeat_to(os.path.join(args.data, file), path, args.examples // 3)
            as_chat(path, fmt, options, chat)
            lines += [f"  - name: {name}", f"    input: {path}", f"    format: {fmt}", f"    weight: {count}"]
            lines += [f"    {k}: {v}" for k, v in options.items()]
    mix_path = os.path.join(work, "mix.yaml")
    with open(mix_path, "w") as f:
        f.write("\n".join(lines) + "\n")

    # Warm-up (imports, bytecode, tokenizer files in the page cache), not measured. It also gives each
    # source's kept examples at L: weighted by those, max_repeats 1 keeps every one of them.
    timed(["--mixture", mix_path, "--output", os.path.join(work, "warm"), "--max-length", *lengths,
           "--allow-short-mix"], beam_args)
    with open(os.path.join(work, "warm", f"L{lengths[0]}", "manifest.json")) as f:
        kept = [s["kept_weight"] for s in json.load(f)["mixture"]["sources"]]
    weights = iter(kept)
    with open(mix_path, "w") as f:
        f.write("\n".join(f"    weight: {next(weights)}" if line.startswith("    weight: ") else line for line in lines) + "\n")
    mixed = timed(["--mixture", mix_path, "--output", os.path.join(work, "mixed"), "--max-length", *lengths,
                   "--allow-short-mix"], beam_args)
    single = timed(["--input", chat_path, "--format", "chat", "--output", os.path.join(work, "single"),
                    "--max-length", *lengths], beam_args)
    same = mixed["tokenized"] == single["tokenized"] and all(
        mixed["stats"][L]["examples_written"] == single["stats"][L]["examples_written"]
        and mixed["stats"][L]["tokens"] == single["stats"][L]["tokens"] for L in mixed["stats"])
    result = {"examples": args.examples, "max_lengths": args.max_length, "mixture": mixed, "one_source": single,
              "cpu_ratio": mixed["cpu"] / single["cpu"], "wall_ratio": mixed["wall"] / single["wall"],
              "same_examples_and_tokens": same}
    print(json.dumps(result, indent=2, default=str))
    print(f"\nmixture CPU {mixed['cpu']:.1f} s vs one source {single['cpu']:.1f} s: {result['cpu_ratio']:.3f}x "
          f"(wall {mixed['wall']:.1f} vs {single['wall']:.1f} s, {result['wall_ratio']:.3f}x); mix stage "
          f"{mixed['mix_s']:.1f} s CPU; same examples and tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
