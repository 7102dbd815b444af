"""`prepack inspect OUTPUT/tokens`: a tokenized set's summary, and examples decoded like rows.

    prepack inspect out/tokens --rows 3 --row-index 100

`prepack inspect` starts here: a folder whose manifest is not a tokenized set's goes on
to apps/inspect.py (shard sets), with the same options.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from prepack import storage
from prepack.cli_help import EXIT_FAILED, EXIT_REFUSED
from apps import inspect as inspect_shards
from apps.inspect import _fmt_bytes, _fmt_int, _load_decoder, _Renderer, _use_color
from loaders.shards import _close_quietly, _open_reader
from prepack.format.manifest import MANIFEST_NAME, ManifestError
from prepack.format.tokenset import TokenSetError, TokenSetManifest, decode_example


def is_token_set(manifest_text: str) -> bool:
    try:
        return json.loads(manifest_text).get("kind") == "tokens"
    except (ValueError, AttributeError, RecursionError):
        return False


def summary_lines(manifest: TokenSetManifest, path: str) -> list[str]:
    tok, s = manifest.tokenizer, manifest.stats
    dropped = s.get("examples_dropped", {})
    reasons = ", ".join(f"{k} {_fmt_int(v)}" for k, v in sorted(dropped.items()))
    lines = [
        f"tokenized set {path}",
        f"  format      tokens v{manifest.format_version}, {_fmt_int(manifest.num_examples)} examples in "
        f"{len(manifest.shards)} files ({_fmt_bytes(manifest.num_bytes)}, {manifest.array_record_options})",
        f"  tokens      {_fmt_int(manifest.tokens)} tokens (targets {_fmt_int(manifest.target_tokens)}), "
        f"{s.get('bytes_per_token', 0):.3f} bytes per token on disk",
        f"  tokenizer   {tok.get('name', '?')} (vocab {_fmt_int(tok.get('vocab_size'))}, bos {tok.get('bos_id')}, "
        f"eos {tok.get('eos_id')}, pad {tok.get('pad_id')}, vocab_hash {str(tok.get('vocab_hash', '?'))[:12]})",
        f"  template    {json.dumps(manifest.template, sort_keys=True)}",
        f"  choices     {json.dumps(manifest.choices, sort_keys=True)}",
    ]
    if manifest.created_at:
        lines.append(f"  created     {manifest.created_at}")
    for entry in manifest.inputs:
        lines.append(f"  input       {json.dumps(entry, sort_keys=True)}")
    lines.append("stats")
    lines.append(f"  examples    read {_fmt_int(s.get('examples_read'))}, kept {_fmt_int(s.get('examples_kept'))}, "
                 f"dropped {_fmt_int(sum(dropped.values()))}{f' ({reasons})' if reasons else ''}")
    lines.append(f"  records     read {_fmt_int(s.get('records_read'))}, filtered {json.dumps(s.get('records_filtered', {}))}")
    if manifest.dropped:
        lines.append(f"  dropped     {manifest.dropped}: the dead letters later runs carry into each shard set")
    return lines


def _first_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def _source(manifest: TokenSetManifest, loc: tuple[int, int, int, int]) -> str:
    task, record, line, sub = loc
    tasks = manifest.job.get("tasks", [])
    meta: dict[str, Any] = tasks[task] if 0 <= task < len(tasks) else {}
    where = meta.get("path", "?")
    if meta.get("byte_start") is not None:
        where += f" (range from byte {meta['byte_start']:,}; record and line counted from there)"
    parts = [where, f"record {record}"]
    if line:
        parts.append(f"line {line}")
    if sub:
        parts.append(f"example {sub}")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = inspect_shards.build_parser().parse_args(argv)
    path = args.path.rstrip("/") or args.path
    if storage.location_problem(args.path):  # inspect_shards says it
        return inspect_shards.main(argv, out, err)
    try:
        text = storage.read_text(storage.join(path, MANIFEST_NAME))
    except ManifestError as e:  # not UTF-8: a damaged or hostile manifest
        print(f"prepack inspect: {e}", file=err or sys.stderr)
        return EXIT_REFUSED
    if not is_token_set(text or ""):
        return inspect_shards.main(argv, out, err)
    return show(path, text or "", args, out or sys.stdout, err or sys.stderr)


def show(path: str, text: str, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        manifest = TokenSetManifest.from_json(text, source=storage.join(path, MANIFEST_NAME))
    except TokenSetError as e:  # the manifest unusable: refused before any row is read
        print(f"prepack inspect: {e}", file=err)
        return EXIT_REFUSED
    print("\n".join(summary_lines(manifest, path)), file=out)
    if args.rows <= 0:
        return 0
    if not 0 <= args.row_index < manifest.num_examples:
        print(f"prepack inspect: --row-index {args.row_index} is outside 0..{manifest.num_examples - 1}", file=err)
        return EXIT_REFUSED
    decode = None if args.ids else _load_decoder(args.tokenizer or manifest.tokenizer.get("name", "gemma3"), manifest,
                                                 err, args.allow_download)
    specials = {int(i): str(t) for t, i in (manifest.tokenizer.get("special_ids") or {}).items() if isinstance(i, int)}
    renderer = _Renderer(decode, _use_color(args.color, out), specials)
    stop = min(manifest.num_examples, args.row_index + args.rows)
    print(f"\nexamples {args.row_index}..{stop - 1} in file order "
          f"({'targets in green' if renderer.color else 'targets between [[ ]]'})", file=out)
    index, first = args.row_index, 0
    for shard in manifest.shards:
        if index >= stop:
            break
        if index >= first + shard.num_rows:
            first += shard.num_rows
            continue
        name = storage.join(path, shard.path)
        wanted = list(range(index - first, min(stop - first, shard.num_rows)))
        try:
            size = storage.file_sizes(path, [shard.path])[shard.path]
            if size != shard.num_bytes:  # truncated or replaced: its reader would fail, or read something else
                raise TokenSetError(f"{'missing' if size is None else f'{size:,} bytes'}, but the manifest says "
                                    f"{shard.num_bytes:,}; the file is truncated or was replaced")
            reader = _open_reader(name)
        except TokenSetError as e:
            print(f"prepack inspect: {name}: {e}: republish the set", file=err)
            return EXIT_FAILED
        except Exception as e:  # noqa: BLE001  (array_record's own words for an unreadable file)
            print(f"prepack inspect: {name}: not a readable ArrayRecord file, truncated or corrupt ({_first_line(e)}): "
                  "republish the set", file=err)
            return EXIT_FAILED
        try:
            try:
                records = reader.read(wanted)
            except Exception as e:  # noqa: BLE001  (riegeli's chunk hash)
                print(f"prepack inspect: {name}: records {wanted[0]}..{wanted[-1]} are unreadable, the file is corrupt "
                      f"({_first_line(e)}): republish the set", file=err)
                return EXIT_FAILED
            for offset, record in zip(wanted, records):
                try:
                    eid, loc, ids, mask, pair = decode_example(record)
                except TokenSetError as e:
                    print(f"prepack inspect: {name}: record {offset}: {e}; the file is corrupt: republish the set", file=err)
                    return EXIT_FAILED
                print(f"example {first + offset}: {eid}, {len(ids):,} tokens, {int(mask.sum()):,} targets; "
                      f"source {_source(manifest, loc)}", file=out)
                sides = [(None, 0, len(ids))] if pair is None else [("chosen", 0, pair[1]), ("rejected", pair[1], len(ids))]
                for side, a, b in sides:
                    if side:
                        print(f"  {side} ({b - a:,} tokens, the first {pair[0]:,} the prompt both sides share)", file=out)
                    print("    " + renderer.segment(ids[a:b], mask[a:b].astype(bool)).replace("\n", "\n    "), file=out)
        finally:
            _close_quietly(reader)
        index = first + wanted[-1] + 1
        first += shard.num_rows
    return 0
