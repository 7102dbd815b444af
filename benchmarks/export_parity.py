"""The exported adapter and merged folder of a real run, against the model training ended with.

Trains --steps steps of `prepack train` in process (any model, e.g. Gemma3 270M on its GGUF
weights), writes the PEFT adapter (`--save-lora`) and `prepack export --merge`'s folder, then
compares on --rows rows of the shard set: the logits of the trained Tunix model with LoRA, of
the merged folder read by Tunix's own loader, and of the merged folder and of base + adapter
(peft's PeftModel) in transformers. Prints the largest differences, relative to the logits'
spread, and the dtype's rounding for scale. What tests/test_peft_export.py checks on tiny
models, on the real one.

    python -m benchmarks.export_parity --shards OUT/L256 --model gemma3-270m --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", required=True)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--rows", type=int, default=2, help="rows of the set whose logits are compared")
    p.add_argument("--tokens", type=int, default=64, help="leading tokens of each row")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="large, so that the adapter moves the logits")
    p.add_argument("--dtype", default=None)
    p.add_argument("--work-dir", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import jax.numpy as jnp
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import loaders
    from train import trainer
    from train.adapter_files import merge_export
    from train.model import models

    work = args.work_dir or tempfile.mkdtemp(prefix="export_parity_")
    adapter, merged, base_dir = (os.path.join(work, n) for n in ("adapter", "merged", "base"))
    cfg = trainer.TrainConfig(shards=args.shards, model=args.model, steps=args.steps, batch_size=args.batch_size,
                              learning_rate=args.learning_rate, dtype=args.dtype, save_lora=adapter, overwrite=True, log_every=1)
    s, _ = trainer.execute(cfg)
    merge_export.merge_export(adapter, merged, overwrite=True)
    family, config = s.built.spec.family, s.built.config
    dtype = s.static["dtype"]
    view = loaders.open_shards(args.shards)
    tokens = np.stack([view[i]["input_ids"][: args.tokens] for i in range(args.rows)]).astype(np.int32)
    n = tokens.shape[1]
    positions = np.broadcast_to(np.arange(n, dtype=np.int32), tokens.shape)
    mask = np.broadcast_to(np.tril(np.ones((n, n), bool)), (tokens.shape[0], n, n))

    def tunix_logits(model, attention_mask) -> np.ndarray:
        return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), None, jnp.asarray(attention_mask))[0], np.float32)

    from train.step import memory_path

    # The trained model reads segment ids where the mask goes unless its attention is dense (train/attention_kernels/attention.py).
    kind = memory_path.attention_kind(cfg)
    trained = tunix_logits(s.built.model, mask if kind == "dense" else np.ones(tokens.shape, np.int32))
    tunix_merged = tunix_logits(family.load_weights(merged, config, jnp.dtype(dtype), None), mask)
    torch_dtype = getattr(torch, dtype)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch_dtype, attn_implementation="eager").eval()
        hf_merged = hf(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
        base_hf = merge_export.base_hf_weights(models.build_model(args.model, weights=s.built.weights, dtype=dtype).model, family, config)
        merge_export.write_hf_folder(base_dir, base_hf, family.hf_config(config, dtype), dtype, True)
        with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch_dtype,
                                                                                      attn_implementation="eager"), adapter).eval()
        hf_peft = with_adapter(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
        with with_adapter.disable_adapter():
            hf_without = with_adapter(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    spread = float(trained.std())
    result = {
        "model": args.model, "dtype": dtype, "steps": args.steps, "logits": list(trained.shape), "logit_std": spread,
        "max_abs_diff": {
            "tunix_merged_vs_trained": float(np.abs(tunix_merged - trained).max()),
            "transformers_merged_vs_trained": float(np.abs(hf_merged - trained).max()),
            "transformers_peft_vs_trained": float(np.abs(hf_peft - trained).max()),
            "adapter_effect (peft without adapter vs with)": float(np.abs(hf_without - hf_peft).max()),
        },
        "mean_abs_diff": {
            "tunix_merged_vs_trained": float(np.abs(tunix_merged - trained).mean()),
            "transformers_merged_vs_trained": float(np.abs(hf_merged - trained).mean()),
            "transformers_peft_vs_trained": float(np.abs(hf_peft - trained).mean()),
            "adapter_effect (peft without adapter vs with)": float(np.abs(hf_without - hf_peft).mean()),
        },
        "argmax_agreement": {
            "transformers_merged": float((hf_merged.argmax(-1) == trained.argmax(-1)).mean()),
            "transformers_peft": float((hf_peft.argmax(-1) == trained.argmax(-1)).mean()),
        },
    }
    print(json.dumps(result, indent=1))
    print("command: " + " ".join(["python -m benchmarks.export_parity", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
