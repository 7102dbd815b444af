"""`prepack inspect DIR`: a shard set's manifest summary, and rows decoded segment by segment.

    prepack inspect gs://bucket/sets/v1/L2048 --rows 3 --row-index 100

Targets (loss_mask 1) are shown in green on a terminal, or between [[ ]]
otherwise (--no-color); prompts and template tokens are shown plain. Text
comes from the tokenizer named in the manifest (prepack.text.tokenizer); if it
cannot be loaded, token ids are shown instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from prepack import storage
from loaders.shards import ShardView, open_shards, read_manifest
from prepack.format import rowformat
from prepack.format.manifest import Manifest, ManifestError
from prepack.wording import counted
from prepack.cli_help import EXIT_FAILED, EXIT_REFUSED, CommandParser

GREEN, RESET = "\033[32m", "\033[0m"


def _fmt_int(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else str(n)


def _fmt_pct(x: Any) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else str(x)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, Mapping):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _fmt_value(value: Any) -> str:
    value = _rounded(value)
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else _fmt_int(value)


def _dropped(value: Any) -> str:
    if isinstance(value, Mapping):
        total = sum(v for v in value.values() if isinstance(v, int))
        reasons = ", ".join(f"{k} {_fmt_int(v)}" for k, v in sorted(value.items()))
        return f"{_fmt_int(total)} ({reasons})" if reasons else "0"
    return _fmt_int(value)


def summary_lines(manifest: Manifest, path: str) -> list[str]:
    tok = manifest.tokenizer
    total_bytes = sum(s.num_bytes for s in manifest.shards)
    lines = [
        f"shard set   {path}",
        f"  format      v{manifest.format_version}, max_length {manifest.max_length}, packing {manifest.packing}",
        f"  rows        {_fmt_int(manifest.num_rows)} in {counted(len(manifest.shards), 'shard')} ({_fmt_bytes(total_bytes)})",
        "  tokenizer   "
        + f"{tok.get('name', '?')} (vocab {_fmt_int(tok.get('vocab_size'))}, bos {tok.get('bos_id')}, "
        + f"eos {tok.get('eos_id')}, pad {tok.get('pad_id')}, vocab_hash {str(tok.get('vocab_hash', '?'))[:12]})",
        f"  template    {json.dumps(manifest.template, sort_keys=True) if manifest.template else '-'}",
    ]
    if manifest.created_at:
        lines.append(f"  created     {manifest.created_at}")
    if manifest.tool:
        lines.append(f"  tool        {json.dumps(manifest.tool, sort_keys=True)}")
    for entry in manifest.inputs:
        lines.append(f"  input       {json.dumps(entry, sort_keys=True)}")

    stats = dict(manifest.stats)
    lines.append("stats")
    if any(k in stats for k in ("examples_read", "examples_written", "examples_dropped", "examples_truncated")):
        lines.append(
            f"  examples    read {_fmt_int(stats.pop('examples_read', '?'))}, written {_fmt_int(stats.pop('examples_written', '?'))}, "
            f"dropped {_dropped(stats.pop('examples_dropped', 0))}, truncated {_fmt_int(stats.pop('examples_truncated', 0))}"
        )
    if "tokens" in stats:
        lines.append(f"  tokens      {_fmt_int(stats.pop('tokens'))} (targets {_fmt_int(stats.pop('target_tokens', '?'))})")
    if "lower_bound_rows" in stats:
        lower = stats.pop("lower_bound_rows")
        ratio = f"; rows/lower bound {manifest.num_rows / lower:.3f}" if isinstance(lower, int) and lower else ""
        lines.append(f"  lower bound {_fmt_int(lower)} rows{ratio}")
    densities = [(k, stats.pop(k)) for k in sorted(stats) if k.endswith("density")]
    if densities:
        lines.append("  density     " + ", ".join(f"{k.removesuffix('_density')} {_fmt_pct(v)}" for k, v in densities))
    for key in sorted(stats):
        lines.append(f"  {key:<11} {_fmt_value(stats[key])}")
    if manifest.dead_letter:
        count = _count_lines(storage.join(path, manifest.dead_letter))
        lines.append(f"  dead letter {manifest.dead_letter}: {'missing' if count is None else f'{count:,} examples'}")
    if manifest.mixture:  # a mixture set: what each source asked for and got (prepack.packing.mix_table)
        from prepack.packing.mix_table import mix_table_lines

        lines += mix_table_lines(manifest.mixture, manifest.max_length)
    return lines


def _count_lines(path: str) -> int | None:
    """The non-blank lines of a dead letter, streamed (it may be large: never held whole); None if missing."""
    try:
        stream = storage.open_stream(path)
    except FileNotFoundError:
        return None
    count, blank = 0, True  # blank: the line read so far holds only whitespace
    with stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            *ended, tail = block.split(b"\n")
            for part in ended:
                count += 0 if blank and not part.strip() else 1
                blank = True
            blank = blank and not tail.strip()
    return count + (0 if blank else 1)


class _Renderer:
    """Turns runs of token ids into text, marking the target runs.

    Special tokens (the manifest's tokenizer special_ids) are shown by name, e.g.
    <start_of_turn>, since decoders usually drop them and they are what shows
    whether a chat template was applied right.
    """

    def __init__(self, decode: Callable[[list[int]], str] | None, color: bool, specials: Mapping[int, str] | None = None):
        self.decode = decode
        self.color = color
        self.specials = dict(specials or {}) if decode else {}

    def _text(self, ids: list[int]) -> str:
        if not self.decode:
            return " ".join(map(str, ids))
        parts, plain = [], []
        for i in ids:
            if i in self.specials:
                if plain:
                    parts.append(self.decode(plain))
                    plain = []
                parts.append(self.specials[i])
            else:
                plain.append(i)
        if plain:
            parts.append(self.decode(plain))
        return "".join(parts)

    def run(self, ids: list[int], target: bool) -> str:
        text = self._text(ids)
        if not target:
            return text
        return f"{GREEN}{text}{RESET}" if self.color else f"[[{text}]]"

    def segment(self, ids: np.ndarray, targets: np.ndarray) -> str:
        # Maximal runs of equal target flag, each decoded as a whole: per-token
        # decoding would lose SentencePiece's spacing.
        cuts = np.flatnonzero(np.diff(targets.astype(np.int8))) + 1
        runs = [self.run(i.tolist(), bool(t[0])) for i, t in zip(np.split(ids, cuts), np.split(targets, cuts)) if len(i)]
        return ("" if self.decode else " ").join(runs)


@dataclasses.dataclass
class MixtureLabels:
    """What labels a mixture set's segments: each source id's name and repeats (the manifest's
    `mixture.sources`, source i at position i - 1), and where each segment shown sits, so that
    the copies of one example (the same tokens, the same source) point at each other."""

    names: dict[int, str]
    repeats: dict[int, float]
    places: dict[tuple[int, bytes, bytes], list[tuple[int, int]]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Manifest) -> "MixtureLabels | None":
        if not manifest.mixture:
            return None
        sources = list(manifest.mixture.get("sources", []))
        return cls({i: str(s["name"]) for i, s in enumerate(sources, start=1)},
                   {i: float(s.get("repeats", 0.0)) for i, s in enumerate(sources, start=1)})

    def note(self, row: Mapping[str, np.ndarray], index: int) -> None:
        for k, key in _segment_keys(row):
            self.places.setdefault(key, []).append((index, k))

    def label(self, row: Mapping[str, np.ndarray], index: int, k: int, key: tuple[int, bytes, bytes]) -> str:
        source = key[0]
        text = f" [source {self.names.get(source, f'#{source}')}]"
        others = [p for p in self.places.get(key, []) if p != (index, k)]
        if others:
            where = ", ".join(f"row {r} segment {s}" for r, s in others[:3]) + (" ..." if len(others) > 3 else "")
            kind = ("a repeated copy: the source is used " f"{self.repeats.get(source, 0):.2f}x"
                    if self.repeats.get(source, 0) > 1 else "a duplicate in the source's input")
            text += f" (same tokens as {where}: {kind})"
        return text


def _segment_keys(row: Mapping[str, np.ndarray]) -> list[tuple[int, tuple[int, bytes, bytes]]]:
    """(segment number, (source id, token bytes, loss-mask bytes)) of a mixture row's segments."""
    seg = row["segment_ids"]
    out = []
    for k in range(1, int(seg.max(initial=0)) + 1):
        where = np.flatnonzero(seg == k)
        out.append((k, (int(row["source_ids"][where[0]]), row["input_ids"][where].tobytes(),
                        row["loss_mask"][where].tobytes())))
    return out


def row_lines(view: ShardView, index: int, renderer: _Renderer, labels: MixtureLabels | None = None) -> list[str]:
    """Raises RowFormatError for a row that breaks the format (a record from a stranger:
    its segment ids would otherwise drive the loop below). `labels`: a mixture set's, to name
    each segment's source and mark the copies of one example."""
    row = raw_row(view, index)
    rowformat.check_row(row, view.max_length)
    keys = dict(_segment_keys(row)) if labels is not None else {}
    seg = row["segment_ids"]
    length = view.max_length
    n_valid = int(row["valid_mask"].sum())
    n_segments = int(seg.max(initial=0))
    lines = [
        f"row {index}: {n_segments} {'segment' if n_segments == 1 else 'segments'}, {n_valid:,}/{length:,} tokens ({100 * n_valid / length:.1f}%), "
        f"{int(row['loss_mask'].sum()):,} targets"
    ]
    for k in range(1, n_segments + 1):
        where = np.flatnonzero(seg == k)
        ids, loss, pos = row["input_ids"][where], row["loss_mask"][where], row["positions"][where]
        side = ""
        if "pair_side" in row:  # a preference set: segments 2k-1 and 2k are pair k's two sides
            side = f", pair {(k + 1) // 2} {'chosen' if int(row['pair_side'][where[0]]) == 1 else 'rejected'}"
        lines.append(
            f"  segment {k}: tokens {where[0]}..{where[-1]} ({len(where)}), positions {pos[0]}..{pos[-1]}, "
            f"{int(loss.sum())} targets{side}{labels.label(row, index, k, keys[k]) if labels is not None else ''}"
        )
        lines.append("    " + renderer.segment(ids, loss.astype(bool)).replace("\n", "\n    "))
    if n_valid < length:
        lines.append(f"  padding: {length - n_valid:,} tokens (id {int(row['input_ids'][-1])})")
    return lines


def _load_decoder(spec: str, manifest: Manifest, err: TextIO, allow_download: bool = False) -> Callable[[list[int]], str] | None:
    try:
        from prepack.text.tokenizer import load_tokenizer

        # Local files only by default: offline, a Hub lookup would retry for a minute before failing.
        tokenizer = load_tokenizer(spec, local_files_only=None if allow_download else True)
    except Exception as e:  # any failure (module absent, spec unknown, files offline) falls back to ids
        print(f"note: tokenizer {spec!r} could not be loaded ({e}); showing token ids", file=err)
        return None
    try:
        identity = tokenizer.identity()
        theirs = manifest.tokenizer.get("vocab_hash")
        if theirs and identity.get("vocab_hash") != theirs:
            print(f"warning: tokenizer {spec!r} has another vocab_hash than the shards'; the text may be wrong", file=err)
    except Exception:
        pass
    return tokenizer.decode


def _use_color(choice: str, out: TextIO) -> bool:
    if choice == "always":
        return True
    if choice == "never":
        return False
    return hasattr(out, "isatty") and out.isatty() and "NO_COLOR" not in os.environ


def shard_sets_under(path: str) -> list[tuple[str, Manifest]]:
    """(folder, manifest) of each published L<max_length>/ shard set directly under a local folder."""
    if storage.is_gcs(path) or not os.path.isdir(path):
        return []
    found = []
    for name in os.listdir(path):
        folder = os.path.join(path, name)
        if name[:1] == "L" and name[1:].isdigit() and os.path.isdir(folder):
            try:
                found.append((folder, read_manifest(folder)))
            except ManifestError:
                continue  # unfinished or damaged: not a shard set to point at
    return sorted(found, key=lambda item: item[1].max_length)


def root_lines(path: str, found: list[tuple[str, Manifest]]) -> list[str]:
    sets = "shard set" if len(found) == 1 else "shard sets"
    lines = [f"{path} holds {len(found)} {sets}, one per max length; inspect one of them:"]
    width = max(len(folder) for folder, _ in found)
    for folder, m in found:
        written = m.stats.get("examples_written")
        examples = f", {_fmt_int(written)} examples" if isinstance(written, int) else ""
        lines.append(f"  prepack inspect {folder:<{width}}   {_fmt_int(m.num_rows)} rows{examples}, packing {m.packing}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="prepack inspect",
                                description="Show a shard set's (or a tokenized set's) manifest summary and decode rows (examples).")
    p.add_argument("path", help="shard set folder, or a tokenized set (OUTPUT/tokens): local, gcsfuse mount or gs://")
    p.add_argument("--rows", type=int, default=2, metavar="N", help="rows (examples) to show (default 2; 0 for the summary only)")
    p.add_argument("--row-index", type=int, default=0, metavar="I", help="first row (example) to show (default 0)")
    p.add_argument("--tokenizer", default=None, metavar="SPEC", help="tokenizer spec to decode with (default: the manifest's)")
    p.add_argument("--allow-download", action="store_true", help="let a Hugging Face tokenizer be downloaded (default: local cache only)")
    p.add_argument("--ids", action="store_true", help="show token ids instead of text")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="mark targets with color (default: on a tty)")
    p.add_argument("--no-color", dest="color", action="store_const", const="never", help="same as --color never: targets in [[ ]]")
    p.add_argument("--verify", action="store_true", help="also check every shard's sha256 (reads every byte)")
    return p


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    path = args.path.rstrip("/") or args.path
    if storage.location_problem(args.path):
        print(f"prepack inspect: {storage.location_problem(args.path)}", file=err)
        return EXIT_REFUSED
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        found = shard_sets_under(path)
        if not found:
            print(f"prepack inspect: {storage.not_a_folder(path) or e}", file=err)
            return EXIT_REFUSED  # no set to show: refused, as verify refuses it
        # An OUTPUT root of `prepack pack --max-length A B ...`: say which shard sets are in it.
        print("\n".join(root_lines(path, found)), file=out)
        return 0
    print("\n".join(summary_lines(manifest, path)), file=out)
    if args.rows <= 0 and not args.verify:
        return 0
    try:
        view = open_shards(path, verify=args.verify)
    except ManifestError as e:
        print(f"prepack inspect: {e}", file=err)
        return EXIT_FAILED
    if args.verify:  # asked for: always run, and say that it passed
        print(f"verified {len(manifest.shards)} shards (sha256)", file=out)
    if args.rows <= 0:
        view.close()
        return 0
    with view:  # a reader that goes away (`| head`) ends the command quietly (apps/cli.py)
        return _show_rows(view, manifest, args, out, err)


def _show_rows(view: ShardView, manifest: Manifest, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if not 0 <= args.row_index < len(view):
        print(f"prepack inspect: --row-index {args.row_index} is outside 0..{len(view) - 1}", file=err)
        return EXIT_REFUSED
    decode = None if args.ids else _load_decoder(
        args.tokenizer or manifest.tokenizer.get("name", "gemma3"), manifest, err, args.allow_download
    )
    special_ids = manifest.tokenizer.get("special_ids")
    specials = {i: str(t) for t, i in (special_ids if isinstance(special_ids, Mapping) else {}).items()
                if isinstance(i, int) and not isinstance(i, bool)}
    renderer = _Renderer(decode, _use_color(args.color, out), specials)
    legend = "targets in green" if renderer.color else "targets between [[ ]]"
    print(f"\nrows {args.row_index}..{min(len(view), args.row_index + args.rows) - 1} ({legend})", file=out)
    shown = range(args.row_index, min(len(view), args.row_index + args.rows))
    labels = MixtureLabels.of(manifest)
    for index in shown if labels is not None else ():  # first where every shown segment sits, so copies point both ways
        try:
            row = raw_row(view, index)
            rowformat.check_row(row, view.max_length)
        except (ManifestError, rowformat.RowFormatError):
            break  # the loop below reports it in one line
        labels.note(row, index)
    for index in shown:
        try:
            lines = row_lines(view, index, renderer, labels)
        except ManifestError as e:  # a record that fails its checksum (ShardSetError names the file)
            print(f"prepack inspect: {e}", file=err)
            return EXIT_FAILED
        except rowformat.RowFormatError as e:
            print(f"prepack inspect: {path_of(view, index)}: row {index} does not follow the row format ({e}); "
                  "the shard is corrupt or not written by prepack: republish the set", file=err)
            return EXIT_FAILED
        print("\n".join(lines), file=out)
    return 0


def raw_row(view: ShardView, index: int) -> dict[str, np.ndarray]:
    """Row `index` as stored: inspect shows a row that breaks the row rules, and says which (check_row)."""
    return {name: values[0] for name, values in view.read([index], check=False).items()}


def path_of(view: ShardView, index: int) -> str:
    """The shard file holding global row `index`."""
    shards, _ = view._locate(np.asarray([index], dtype=np.int64))
    return view.shard_paths[int(shards[0])]


if __name__ == "__main__":
    sys.exit(main())
