"""`prepack tokenizer-folder`: Gemma 3's tokenizer as a Hugging Face folder, with a chat template,
built offline from the packaged GGUF, for `--tokenizer hf:FOLDER --chat-format hf`.

    prepack tokenizer-folder --output gemma3-tools
    prepack pack --input calls.jsonl --format chat --tokenizer hf:gemma3-tools --chat-format hf --output packed
    prepack generate --input heldout.jsonl --format chat --tokenizer hf:gemma3-tools --chat-format hf \\
        --model gemma3-270m --lora adapter --score --output tuned.jsonl

The ids are those of `--tokenizer gemma3`, so Gemma 3 270M's weights read them; the default
template writes tool calls in FunctionGemma's layout, with FunctionGemma's seven control tokens
(prepack/text/gemma3_hf_folder.py says where they live). A folder downloaded from the Hub
(google/functiongemma-270m-it, google/gemma-3-270m-it) works the same way where it can be reached.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prepack.cli_help import CommandParser

PROG = "prepack tokenizer-folder"
TEMPLATES = ("functiongemma-layout", "none")
# Chat templates are kilobytes (Qwen3's is 4 KiB); a larger --template is not one.
MAX_TEMPLATE_BYTES = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, metavar="DIR", help="the folder to write (new or empty, else --overwrite)")
    p.add_argument("--template", default="functiongemma-layout", metavar="NAME_OR_FILE",
                   help="the chat template: 'functiongemma-layout' (tool calls in FunctionGemma's layout), 'none', "
                        "or a jinja file")
    p.add_argument("--no-function-tokens", dest="function_tokens", action="store_false",
                   help="leave out FunctionGemma's control tokens: the vocabulary is then exactly Gemma 3's")
    p.add_argument("--overwrite", action="store_true", help="replace the tokenizer files of a folder that has files (every other file there stays)")
    return p


def read_template(spec: str) -> str | None:
    from prepack.text import gemma3_hf_folder

    if spec == "none":
        return None
    path = gemma3_hf_folder.FUNCTIONGEMMA_LAYOUT if spec == "functiongemma-layout" else Path(spec)
    if not path.is_file():
        raise gemma3_hf_folder.FolderError(f"--template {spec}: no such file; name one of {', '.join(TEMPLATES)} or a "
                                           "jinja file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)
        if len(data) > MAX_TEMPLATE_BYTES:
            raise gemma3_hf_folder.FolderError(f"--template {spec}: over {MAX_TEMPLATE_BYTES:,} bytes, too large for a "
                                               "chat template; name the jinja file of one")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise gemma3_hf_folder.FolderError(f"--template {spec}: cannot read it as UTF-8 text ({e})") from None


def output_problem(output: str) -> str | None:
    """Why --output names no local folder this command may write (one line), or None: `hf:FOLDER`
    reads a local folder, and a symlink would put the files somewhere the user did not name."""
    from prepack import storage

    problem = storage.location_problem(output)
    if problem is None and storage.is_gcs(output):
        problem = f"{output!r} is not on this machine: --tokenizer hf:FOLDER reads a local folder, so write one here"
    if problem is None and Path(output).is_symlink():
        problem = f"{output!r} is a symbolic link: name the folder itself (or a new one)"
    if problem is None:  # before the tokenizer is built (seconds): /proc/x was a traceback after them
        problem = storage.local_write_problem(output)
    return f"--output {problem}" if problem else None


def write_folder(output: str, chat_template: str | None, function_tokens: bool, overwrite: bool) -> Path:
    """Writes the folder (tokenizer.json, tokenizer_config.json, the chat template) into `output`:
    a new or empty folder, or with `overwrite` any folder, where every tokenizer file
    (TOKENIZER_FILES) is replaced or removed and nothing else is touched (a stale chat template or
    tokenizer.model left beside the new files would be read with them). Written whole beside the
    folder first (prepack/storage/own_files.py): a failed save leaves the old files as they were."""
    from prepack.storage import own_files
    from prepack.text import gemma3_hf_folder
    from prepack.text.gemma3_hf_folder import FolderError

    out = Path(output)
    if out.exists() and not out.is_dir():
        raise FolderError(f"{out} exists and is not a folder: choose another --output")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FolderError(f"{out} already exists and is not an empty folder: choose another --output, "
                          f"or pass --overwrite to replace its tokenizer files")
    fast = gemma3_hf_folder.fast_tokenizer(chat_template, function_tokens)
    try:
        own_files.write_own_files(str(out), fast.save_pretrained, lambda name: name in gemma3_hf_folder.TOKENIZER_FILES)
    except own_files.OwnFilesError as e:
        raise FolderError(f"save_pretrained: {e}") from None
    return out


def run_paths(args: argparse.Namespace) -> Any:
    """What a run reads and writes, for the one output rule (prepack/storage/output_rule.py): the
    folder apart from a --template file, the working folder and the folders above it."""
    from prepack.storage import output_rule

    template = [] if args.template in TEMPLATES else [output_rule.Place("--template", args.template)]
    return output_rule.RunPaths(template, [output_rule.Place("--output", args.output)])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from prepack.storage import output_rule
    from prepack.text import gemma3_hf_folder

    try:
        try:  # a dangling link or a link loop named as such, before output_problem calls it a link
            resolved = output_rule.output_path("--output", args.output)
        except output_rule.OutputPathError as e:
            raise gemma3_hf_folder.FolderError(str(e)) from None
        problem = output_problem(args.output)
        args.output = resolved  # the one string the rule judges and the folder is written at
        problem = problem or output_rule.refusal(run_paths(args))
        if problem:
            raise gemma3_hf_folder.FolderError(problem)
        template = read_template(args.template)
        if template is not None and "<start_function" in template and not args.function_tokens:
            raise gemma3_hf_folder.FolderError(
                "--no-function-tokens: the template writes FunctionGemma's control tokens, which would then be plain "
                "text (a calling turn could not end on one); keep the tokens or use another --template")
        out = write_folder(args.output, template, args.function_tokens, args.overwrite)
    except gemma3_hf_folder.FolderError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    print(f"wrote Gemma 3's tokenizer to {out} ({'with' if args.function_tokens else 'without'} FunctionGemma's control "
          f"tokens, template: {args.template}); use it with --tokenizer hf:{out} --chat-format hf")
    return 0


if __name__ == "__main__":
    sys.exit(main())
