"""XLA's planned memory of the whole LoRA train step, before and after the memory path (CPU plan).

Compiles (never runs) Tunix's train step for real model configs with random bf16 weights and
LoRA rank 16, at each (B, L): "before" = full logits, dense attention, no remat (today's path);
"after" = the defaults of `prepack train` (chunked loss, blocked attention, remat auto against
the budget). One compile at a time (they take several GiB of host memory).

    python -m benchmarks.bench_memory_path                       # Gemma3 270M, the issue's table
    python -m benchmarks.bench_memory_path --model qwen3-0.6b --shapes 4x1024,8x2048
    python -m benchmarks.bench_memory_path --largest             # largest B*L under the budget, after
    python -m benchmarks.bench_memory_path --shapes 8x1024 --chunks 512,1024,2048,4096   # the chunk default
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time

GIB = 1024**3
ISSUE_SHAPES = "4x1024,8x1024,8x2048,16x2048,4x4096,2x8192"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    loss_chunk_tokens: int
    attention: str
    remat: str


BEFORE = Variant("before", 0, "dense", "none")
AFTER = Variant("after", 1024, "blocked", "auto")


def make_trainer(model_name: str, variant: Variant, max_length: int, remat_on: bool):
    import jax.numpy as jnp
    import optax
    from tunix.sft import peft_trainer

    from train.model import models
    from train.run_config import config
    from train.step import memory_path, precision

    cfg = config.TrainConfig(shards="-", model=model_name, loss_chunk_tokens=variant.loss_chunk_tokens,
                             attention=variant.attention)
    built = models.build_model(model_name, weights="random", dtype="bfloat16")
    model = models.apply_lora(built.model, built.spec, rank=16)
    memory_path.install_attention(model, cfg, max_length)
    memory_path.set_remat(model, remat_on)
    trainer = peft_trainer.PeftTrainer(model, optax.adamw(1e-4), peft_trainer.TrainingConfig(eval_every_n_steps=1, max_steps=1))
    trainer.with_gen_model_input_fn(memory_path.gen_model_input_fn(cfg))
    trainer.with_loss_fn(precision.in_compute_dtype(memory_path.choose_sft_loss(cfg), jnp.bfloat16), has_aux=True)
    return trainer


def plan(model_name: str, variant: Variant, b: int, length: int, budget: int) -> dict:
    from train import memory_plan

    remat_on = variant.remat == "layer"
    result = memory_plan.plan_step(make_trainer(model_name, variant, length, remat_on), b, length)
    if variant.remat == "auto" and not result.fits(budget):
        gc.collect()
        remat_on = True
        result = memory_plan.plan_step(make_trainer(model_name, variant, length, True), b, length)
    gc.collect()
    return {"variant": variant.name, "B": b, "L": length, "tokens": b * length, "remat": remat_on,
            "argument_gib": result.argument_bytes / GIB, "temp_gib": result.temp_bytes / GIB,
            "peak_gib": result.peak_bytes / GIB, "xla_flops": result.xla_flops, "fits": result.fits(budget),
            "compile_s": result.compile_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--shapes", default=ISSUE_SHAPES, help="BxL,BxL,...")
    p.add_argument("--variants", default="before,after")
    p.add_argument("--budget-gib", type=float, default=16.0)
    p.add_argument("--largest", action="store_true", help="double B at each L until the 'after' plan no longer fits")
    p.add_argument("--lengths", default="2048,4096,8192", help="L values for --largest")
    p.add_argument("--chunks", default=None, help="N,N,...: the 'after' variant at each --loss-chunk-tokens N instead")
    args = p.parse_args()
    budget = int(args.budget_gib * GIB)
    variants = {"before": BEFORE, "after": AFTER}
    rows = []
    started = time.perf_counter()
    if args.chunks:
        for shape in args.shapes.split(","):
            b, length = (int(x) for x in shape.split("x"))
            for n in (int(x) for x in args.chunks.split(",")):
                row = plan(args.model, dataclasses.replace(AFTER, name=f"chunk {n}", loss_chunk_tokens=n), b, length, budget)
                rows.append(row)
                print(json.dumps(row), flush=True)
    elif args.largest:
        for length in (int(x) for x in args.lengths.split(",")):
            b, best = 1, None
            while True:
                row = plan(args.model, AFTER, b, length, budget)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if not row["fits"]:
                    break
                best, b = row, b * 2
            print(f"L={length}: largest fitting B={best['B'] if best else 0} ({best['tokens'] if best else 0:,} tokens)", flush=True)
    else:
        for shape in args.shapes.split(","):
            b, length = (int(x) for x in shape.split("x"))
            for name in args.variants.split(","):
                row = plan(args.model, variants[name], b, length, budget)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{args.model}, bf16, LoRA 16, CPU plan; budget {args.budget_gib} GiB; {time.perf_counter() - started:.0f} s")
    print("| variant | (B, L) | tokens | remat | temp GiB | peak GiB | fits |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | ({r['B']}, {r['L']}) | {r['tokens']:,} | {'layer' if r['remat'] else 'none'} | "
              f"{r['temp_gib']:.1f} | {r['peak_gib']:.1f} | {'yes' if r['fits'] else 'no'} |")


if __name__ == "__main__":
    main()
