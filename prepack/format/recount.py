"""A shard set's manifest against its rows: every figure it states that a recount of the rows and
its dead letter reproduces, or bounds, judged in one place (`prepack verify`).

The rows give the counts (rows, segments, tokens, targets, per source), and from them the
figures the job derived (densities, lower bound, row reduction: prepack.packing.stats, the one
place of those formulas). The dead letter gives the drops by reason. What no recount reaches is
held to the identities the job published it under (the accounting identity of every max length
and of every mixture source, prepack.packing.accounting and mixture) and to bounds (BFD's rows
no fewer than the rows written, no more replayed context than loss-0 tokens, ...). The
tokenizer is judged against the embedded one of its name (gemma3, qwen3), and a mixture's
source names against the formats its `template` records for them. Each check says, in one line,
the key, what the manifest states and what the rows (or the identity) give.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from typing import Any

import numpy as np

from prepack.format import rowformat
from prepack.format.manifest import EDITED, MAX_VOCAB_SIZE, Manifest, tokenizer_facts_problem
from prepack.packing.accounting import NOT_BAD_INPUT, arrival_problem
from prepack.packing.packer import DropReason
from prepack.packing.stats import PackingStats

# The tokenizers `prepack verify` can load offline and compare a manifest's identity with.
EMBEDDED_TOKENIZERS = ("gemma3", "qwen3")
_IDENTITY_KEYS = ("vocab_size", "vocab_hash", "bos_id", "eos_id", "pad_id", "special_ids")
_EDITED = EDITED


@dataclasses.dataclass
class Recount:
    """What the rows hold, counted as they stream by (`add` each batch that passed row_fault)."""

    num_sources: int = 0  # a mixture's; 0 without one
    preference: bool = False  # a preference set's rows: `segments` counts pairs (each two segments)
    rows: int = 0
    segments: int = 0
    tokens: int = 0
    target_tokens: int = 0
    min_segments: int | None = None
    max_segments: int = 0
    rejected_tokens: int = 0  # a preference set's rejected sides (the chosen sides hold the rest)
    rejected_target_tokens: int = 0
    # [source id, (segments, tokens, target tokens)]; row 0 is padding's, unused.
    by_source: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.by_source = np.zeros((self.num_sources + 1, 3), np.int64)

    def add(self, batch: dict[str, np.ndarray]) -> None:
        self.preference = rowformat.PAIR_SIDE in batch
        counts = rowformat.row_counts(batch)
        self.rows += len(counts["segments"])
        self.segments += int(counts["segments"].sum())
        self.tokens += int(counts["tokens"].sum())
        self.target_tokens += int(counts["target_tokens"].sum())
        low = int(counts["segments"].min())  # a batch holds at least one row
        self.min_segments = low if self.min_segments is None else min(self.min_segments, low)
        self.max_segments = max(self.max_segments, int(counts["segments"].max()))
        if self.preference:
            rejected = batch[rowformat.PAIR_SIDE] == rowformat.REJECTED
            self.rejected_tokens += int(rejected.sum())
            self.rejected_target_tokens += int(batch["loss_mask"][rejected].sum())
        if self.num_sources:
            src, seg = batch["source_ids"], batch["segment_ids"]
            starts = (seg != 0) & (np.diff(seg, axis=1, prepend=0) != 0)
            if rowformat.PAIR_SIDE in batch:  # a pair is one example: count its chosen side's start
                starts &= batch[rowformat.PAIR_SIDE] == rowformat.CHOSEN
            size = self.num_sources + 1
            self.by_source[:, 0] += np.bincount(src[starts], minlength=size)
            self.by_source[:, 1] += np.bincount(src.ravel(), minlength=size)
            self.by_source[:, 2] += np.bincount(src.ravel(), weights=batch["loss_mask"].ravel(), minlength=size).astype(np.int64)


def row_facts(manifest: Manifest) -> rowformat.RowFacts:
    """What the row rules judge the set's rows by: its version, vocabulary, pad id and sources
    (a figure the manifest does not state as an integer is not judged; `tokenizer_problem` says so)."""
    tok = manifest.tokenizer
    vocab, pad = tok.get("vocab_size"), tok.get("pad_id")
    return rowformat.RowFacts(
        manifest.format_version,
        vocab_size=vocab if _is_int(vocab) and 1 < vocab <= MAX_VOCAB_SIZE else None,
        pad_id=pad if _is_int(pad) else None,
        num_sources=len(manifest.mixture["sources"]) if rowformat.has_sources(manifest.format_version) else None)


def misstatement(manifest: Manifest, recount: Recount, where: str, dead_letter: Counter | None = None) -> str | None:
    """The first figure `manifest` (at `where`) states that its rows, dead letter (reason -> entries,
    None: no file) and its own identities contradict, in one line; None when every one holds."""
    for check in (_counted, _derived, _accounting, _bounds, _mixture):
        line = check(manifest, recount, where)
        if line:
            return line
    return _dead_letter(manifest, where, dead_letter or Counter())


def tokenizer_problem(manifest: Manifest, where: str, load: Any = None) -> str | None:
    """The tokenizer identity judged: `vocab_size` an integer from 2 to MAX_VOCAB_SIZE, the special
    ids inside it, and for an embedded tokenizer (gemma3, qwen3) every key of its identity equal to
    what that tokenizer says (vocab_size edited to another tokenizer's, or to 10^9, is caught even
    where every row's id lies below it). `load`: the tokenizer loader (tests)."""
    tok = manifest.tokenizer
    problem = tokenizer_facts_problem(tok, where, vocab_required=True)  # the readers' own rule
    if problem:
        return problem
    if tok.get("pad_id") is None:
        return f"{where}: tokenizer.pad_id is missing: padding cannot be judged; {_EDITED}"
    name = tok.get("name")
    if name not in EMBEDDED_TOKENIZERS:
        return None
    identity = load(name).identity() if load is not None else _embedded_identity(name)
    for key in _IDENTITY_KEYS:
        if key == "special_ids" and isinstance(tok.get(key), dict):
            # Names the manifest gives must be the tokenizer's; an older set may name fewer (Gemma 3's
            # reserved image pieces became control pieces, and so special ids, after sets were made).
            wrong = sorted((k, v) for k, v in tok[key].items() if identity["special_ids"].get(k) != v)
            if wrong:
                k, v = wrong[0]
                return (f"{where}: tokenizer.special_ids[{k!r}] is {_shown(v)}, but the embedded tokenizer {name!r} has "
                        f"{_shown(identity['special_ids'].get(k))}; {_EDITED}")
        elif key in tok and tok[key] != identity.get(key):
            return (f"{where}: tokenizer.{key} is {_shown(tok[key])}, but the embedded tokenizer {name!r} has "
                    f"{_shown(identity.get(key))}; the manifest was edited, or the set was made by another {name} vocabulary")
    return None


def source_names_problem(manifest: Manifest, where: str, recorded: dict[str, Any] | None = None) -> str | None:
    """A mixture's source names against what else names them: each source's format as the set's
    `template.sources` records it for that name, and (`recorded`: the tokenized set's recorded
    mixture, when verify finds the set's) the sources in order (names swapped are caught even
    between two sources of one format)."""
    if not manifest.mixture:
        return None
    sources = manifest.mixture["sources"]
    templates = manifest.template.get("sources") if isinstance(manifest.template.get("sources"), dict) else {}
    names = [s.get("name") for s in sources]
    if sorted(map(str, templates)) != sorted(map(str, names)):
        return f"{where}: mixture.sources names {names}, but template.sources names {sorted(templates)}; {_EDITED}"
    for k, source in enumerate(sources):
        recorded_format = templates[source["name"]].get("name") if isinstance(templates[source["name"]], dict) else None
        if source.get("format") != recorded_format:
            return (f"{where}: mixture.sources[{k}] is named {source['name']!r} with format {source.get('format')!r}, but "
                    f"template.sources[{source['name']!r}] records format {recorded_format!r} for that name; {_EDITED}")
    if recorded is not None and isinstance(recorded.get("sources"), list):
        theirs = [(s.get("name"), s.get("format")) for s in recorded["sources"] if isinstance(s, dict)]
        mine = [(s.get("name"), s.get("format")) for s in sources]
        if mine != theirs:
            return (f"{where}: mixture.sources are {mine} (name, format) in source-id order, but the tokenized set these "
                    f"rows were packed from records {theirs}; {_EDITED}")
    return None


# ----------------------------------------------------------------------------- the checks


def _counted(manifest: Manifest, recount: Recount, where: str) -> str | None:
    """The counts the rows reproduce exactly."""
    stats = manifest.stats
    spread = stats.get("segments_per_row") if isinstance(stats.get("segments_per_row"), dict) else {}
    figures = [
        ("num_rows", manifest.num_rows, recount.rows),
        ("stats.rows", stats.get("rows"), recount.rows),
        ("stats.examples_written", stats.get("examples_written"), recount.segments),
        ("stats.tokens", stats.get("tokens"), recount.tokens),
        ("stats.target_tokens", stats.get("target_tokens"), recount.target_tokens),
        ("stats.segments_per_row.min", spread.get("min"), recount.min_segments or 0),
        ("stats.segments_per_row.max", spread.get("max"), recount.max_segments),
    ]
    if "planned_examples" in stats:
        figures.append(("stats.planned_examples", stats["planned_examples"], recount.segments))
    if recount.preference:  # a preference set: its pair figures are the example figures, by side
        figures += [("stats.pairs_written", stats.get("pairs_written"), recount.segments),
                  ("stats.pairs_read", stats.get("pairs_read"),
                   stats["examples_read"] if _is_int(stats.get("examples_read")) else -1),
                  ("stats.chosen_tokens", stats.get("chosen_tokens"), recount.tokens - recount.rejected_tokens),
                  ("stats.rejected_tokens", stats.get("rejected_tokens"), recount.rejected_tokens),
                  ("stats.chosen_target_tokens", stats.get("chosen_target_tokens"),
                   recount.target_tokens - recount.rejected_target_tokens),
                  ("stats.rejected_target_tokens", stats.get("rejected_target_tokens"), recount.rejected_target_tokens)]
        if stats.get("pairs_dropped") != stats.get("examples_dropped"):
            return (f"{where}: stats.pairs_dropped is {_shown(stats.get('pairs_dropped'))}, but examples_dropped is "
                    f"{_shown(stats.get('examples_dropped'))} (a pair is one example); {_EDITED}")
    for i, source in enumerate(manifest.mixture["sources"] if recount.num_sources else (), start=1):
        for column, key in enumerate(("examples_written", "tokens", "target_tokens")):
            figures.append((f"mixture.sources[{i - 1}].{key} ({source.get('name')})", source.get(key), int(recount.by_source[i, column])))
    for key, stated, counted in figures:
        if not _is_int(stated) or stated != counted:
            return f"{where}: {key} is {_shown(stated)}, but the rows hold {counted:,}; {_EDITED}"
    return None


def _derived(manifest: Manifest, recount: Recount, where: str) -> str | None:
    """The figures the job derived from the counts (prepack.packing.stats): equal to the same
    formula on the recount, to the last bit (both are the same float operations)."""
    figures = PackingStats(manifest.max_length, recount.segments, recount.tokens, recount.target_tokens, recount.rows,
                           recount.min_segments or 0, recount.max_segments).as_dict()
    stats = manifest.stats
    expected: dict[str, Any] = {k: v for k, v in figures.items() if k not in ("max_length", "examples", "segments_per_row")}
    expected["segments_per_row.mean"] = figures["segments_per_row"]["mean"]
    dropped = stats.get("examples_dropped") if isinstance(stats.get("examples_dropped"), dict) else {}
    bad = sum(v for k, v in dropped.items() if k not in NOT_BAD_INPUT and _is_int(v))
    if "bad_records" in stats:
        expected["bad_records"] = bad
    if "bad_fraction" in stats and _is_int(stats.get("examples_read")):
        expected["bad_fraction"] = bad / stats["examples_read"] if stats["examples_read"] else 0.0
    for key, value in expected.items():
        head, _, sub = key.partition(".")
        if head not in stats:
            continue  # an older manifest without the figure states nothing
        stated = stats[head]
        if sub:
            if isinstance(stated, dict) and sub not in stated:
                continue  # likewise a figure left out of the object
            stated = stated.get(sub) if isinstance(stated, dict) else None
        if type(stated) not in (int, float) or stated != value:
            return f"{where}: stats.{key} is {_shown(stated)}, but the rows give {_shown(value)}; {_EDITED}"
    return None


def _accounting(manifest: Manifest, recount: Recount, where: str) -> str | None:
    """The accounting identity the job published the set under (prepack.packing.accounting): with
    examples_written recounted, an edited examples_read or examples_dropped breaks it."""
    stats = manifest.stats
    keys = ("examples_read", "examples_split", "split_pieces", "examples_windowed", "window_pieces", "examples_repeated")
    values = {k: stats.get(k) or 0 for k in keys}
    dropped = stats.get("examples_dropped")
    for key, value in [*values.items(), *((f"examples_dropped.{r}", v) for r, v in (dropped or {}).items())]:
        if not _is_int(value) or value < 0:
            return f"{where}: stats.{key} is {_shown(value)}, not a count; {_EDITED}"
    if not isinstance(dropped, dict):
        return f"{where}: stats.examples_dropped is {_shown(dropped)}, not an object of counts by reason; {_EDITED}"
    problem = arrival_problem(values["examples_read"], recount.segments, sum(dropped.values()), values["examples_split"],
                              values["split_pieces"], values["examples_windowed"], values["window_pieces"],
                              values["examples_repeated"])
    if problem:
        return f"{where}: the accounting does not add up: {problem}; {_EDITED}"
    return None


def _bounds(manifest: Manifest, recount: Recount, where: str) -> str | None:
    """The figures no recount reaches, bounded by what the rows and the other figures allow."""
    stats = manifest.stats
    dropped = stats["examples_dropped"]
    checks = [
        ("bfd_rows", stats.get("bfd_rows"), recount.rows, None, "at least the rows written (BFD is the fallback plan)"),
        ("examples_truncated", stats.get("examples_truncated"), 0, stats.get("examples_read") or 0, "at most the examples read"),
        ("split_pieces", stats.get("split_pieces"), 2 * (stats.get("examples_split") or 0), None,
         "at least 2 pieces for each example split"),
        ("window_pieces", stats.get("window_pieces"), stats.get("examples_windowed") or 0, None,
         "at least one piece for each example windowed"),
        ("examples_dropped.no_targets_after_split", dropped.get(DropReason.NO_TARGETS_AFTER_SPLIT.value), 0,
         stats.get("split_pieces") or 0, "at most the pieces split"),
        ("context_tokens_replayed", stats.get("context_tokens_replayed"), 0, recount.tokens - recount.target_tokens,
         "at most the loss-0 tokens of the rows"),
        ("records_read", stats.get("records_read"), 0, None, "a count"),
    ]
    for key, stated, low, high, rule in checks:
        if stated is None:
            continue
        if not _is_int(stated) or stated < low or (high is not None and stated > high):
            return f"{where}: stats.{key} is {_shown(stated)}, but it must be {rule} ({low:,} to {'any' if high is None else f'{high:,}'}); {_EDITED}"
    return None


def _mixture(manifest: Manifest, recount: Recount, where: str) -> str | None:
    """A mixture's per-source figures: their own identity, their sums against the set's, and the
    shares, repeats and limiting source recomputed from them (prepack.packing.mixture)."""
    if not recount.num_sources:
        return None
    from prepack.packing.mixture import MixtureError, source_accounting_problem, stated_figures_problem

    mixture, stats = manifest.mixture, manifest.stats
    sources = mixture["sources"]
    for k, f in enumerate(sources):
        for key in ("examples_read", "examples_unique", "examples_split", "split_pieces", "kept_weight", "written_weight"):
            if not _is_int(f.get(key)) or f[key] < 0:
                return f"{where}: mixture.sources[{k}].{key} ({f.get('name')}) is {_shown(f.get(key))}, not a count; {_EDITED}"
        if not isinstance(f.get("examples_dropped"), dict) or not all(_is_int(v) for v in f["examples_dropped"].values()):
            return f"{where}: mixture.sources[{k}].examples_dropped ({f.get('name')}) is not an object of counts; {_EDITED}"
        unique, written = f["examples_unique"], f["examples_written"]
        if unique > written or (unique > 0) != (written > 0):
            return (f"{where}: mixture.sources[{k}].examples_unique ({f['name']}) is {f['examples_unique']}, but the rows "
                    f"hold {f['examples_written']:,} copies of its examples (at least one each); {_EDITED}")
        problem = source_accounting_problem(f)
        if problem:
            return f"{where}: the accounting does not add up: {problem}; {_EDITED}"
    sums = {"examples_read": stats["examples_read"], "examples_split": stats.get("examples_split") or 0,
            "split_pieces": stats.get("split_pieces") or 0}
    for key, total in sums.items():
        if sum(f[key] for f in sources) != total:
            return (f"{where}: mixture.sources' {key} add up to {sum(f[key] for f in sources):,}, but stats.{key} is "
                    f"{total:,}; {_EDITED}")
    repeated = sum(f["examples_written"] - f["examples_unique"] for f in sources)
    if (stats.get("examples_repeated") or 0) != repeated:
        return (f"{where}: stats.examples_repeated is {_shown(stats.get('examples_repeated'))}, but the sources wrote "
                f"{repeated:,} copies beyond each example's first; {_EDITED}")
    by_reason = Counter()
    for f in sources:
        by_reason.update(f["examples_dropped"])
    if +by_reason != +Counter(stats["examples_dropped"]):
        return (f"{where}: mixture.sources' examples_dropped add up to {dict(sorted(by_reason.items()))}, but "
                f"stats.examples_dropped is {dict(sorted(stats['examples_dropped'].items()))}; {_EDITED}")
    if not rowformat.has_example_targets(manifest.format_version):
        column = 2 if mixture.get("weight_of") == "target_tokens" else 0  # what a whole example weighs in the rows
        for i, f in enumerate(sources, start=1):
            if f["written_weight"] != int(recount.by_source[i, column]):
                return (f"{where}: mixture.sources[{i - 1}].written_weight ({f['name']}) is {f['written_weight']:,}, but "
                        f"the rows hold {int(recount.by_source[i, column]):,} of its {mixture.get('weight_of')}; {_EDITED}")
    try:
        problem = stated_figures_problem(mixture)
    except MixtureError as e:
        return f"{where}: {e}; {_EDITED}"
    return f"{where}: {problem}; {_EDITED}" if problem else None


def _dead_letter(manifest: Manifest, where: str, counted: Counter) -> str | None:
    """The dead letter holds one entry for each example dropped (a share rule's not_sampled
    excepted: those were left out, not refused), with its reason."""
    stats = manifest.stats
    entries = sum(counted.values())
    if "dead_letter_entries" in stats and stats["dead_letter_entries"] != entries:
        return (f"{where}: stats.dead_letter_entries is {_shown(stats['dead_letter_entries'])}, but the dead letter "
                f"{manifest.dead_letter or '(none)'} holds {entries:,}; {_EDITED}")
    stated = {r: n for r, n in stats["examples_dropped"].items() if r != DropReason.NOT_SAMPLED.value and n}
    if stated != dict(+counted):
        return (f"{where}: stats.examples_dropped is {dict(sorted(stated.items()))} (not_sampled aside), but the dead "
                f"letter {manifest.dead_letter or '(none)'} holds {dict(sorted((+counted).items()))}; {_EDITED}")
    return None


@functools.lru_cache(maxsize=None)
def _embedded_identity(name: str) -> dict[str, Any]:
    """An embedded tokenizer's identity, loaded once per process (an output's lengths share it)."""
    from prepack.text.tokenizer import load_tokenizer

    return load_tokenizer(name).identity()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    from prepack.hostile_input.untrusted import shown

    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return str(value) if _is_int(value) else shown(value)
