"""The `prepack` console script. Each subcommand imports its own side lazily,
so `prepack pack` never imports JAX and `prepack train` never imports Beam."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function taking argv, the extra it needs, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "pack": ("pipelines.cli", "main", "pipeline", "run the Beam packing job: inputs -> ArrayRecord shard sets, one per max length"),
    "inspect": ("apps.inspect", "main", "train", "print a shard set's manifest summary and decode rows segment by segment"),
    "preflight": ("apps.preflight", "main", "pipeline,report", "estimate packing gains from the tokenizer alone, with tables and plots"),
    "report": ("apps.report", "main", "report", "render manifests and training metrics into one page with plots"),
    "train": ("train.cli", "main", "train", "LoRA SFT with Tunix on a shard set, packed or unpacked"),
}


def _usage() -> str:
    lines = ["usage: prepack <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, _, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `prepack <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"prepack: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, extra, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        print(f"prepack {name}: missing dependency ({e}); install with: pip install 'tunix-prepack[{extra}]'", file=sys.stderr)
        return 2
    return int(getattr(module, func_name)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
