"""The job's two configs: `RowSpec`, what makes the rows, and `RunOptions`, how this run behaves.

A RowSpec is what `prepack pack`, `prepack preflight` and the manifest share: two runs with equal
RowSpecs over equal inputs write byte-identical shards, and each manifest records
`RowSpec.manifest_options()`. RunOptions (the output folder, overwriting, locks, logging, the
tokenize batch) never change a byte of the rows. `PackConfig` is the pair the job runs on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipelines.inputs.limits import InputLimits
from pipelines.output.lock import DEFAULT_EXPIRY_S
from prepack.packing.bad_records import DEFAULT_MAX_BAD_FRACTION
from prepack.packing.mixture import Mixture
from prepack.packing.packer import OverlongPolicy, Planner

DEFAULT_MAX_LENGTHS = (2048,)
DEFAULT_TARGET_SHARD_MB = 256.0
DEFAULT_TOKENIZE_BATCH_SIZE = 512


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """What makes the rows and shards: the examples (inputs, templates, tokenizer, chat format),
    how they are fitted to each max length, and how rows are planned and sharded."""

    inputs: tuple[str, ...]
    format: str
    template_options: tuple[tuple[str, str], ...] = ()
    chat_format: str = "auto"
    tokenizer: str = "gemma3"
    max_lengths: tuple[int, ...] = DEFAULT_MAX_LENGTHS
    pack: bool = True
    overlong: OverlongPolicy = OverlongPolicy.DROP
    window_context_tokens: int | None = None  # --overlong window: N; None: L // 4 at each max length
    planner: Planner = Planner.BEST
    max_segments_per_row: int | None = None  # None: no cap
    num_shards: int | None = None
    target_shard_mb: float = DEFAULT_TARGET_SHARD_MB
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION
    sub_buckets: int | None = None  # None: derived from the input size (planning.choose_sub_buckets)
    tfds_data_dir: str | None = None
    limits: InputLimits = InputLimits()  # what one input may make a worker hold; a longer record is dropped
    # Every run is a mixture. --mixture: the parsed mixture file; `inputs` are then its sources'
    # inputs in file order and `format` is "mixture" (each source has its own,
    # prepack/packing/mixture.py). A plain run: left out, it is the one source of `inputs` and
    # `format` (Mixture.single), which no set records.
    mixture: Mixture = None  # type: ignore[assignment]  # set by __post_init__ when left out
    train_reasoning: bool = True  # --train-reasoning: a reasoning trace's think block is a target (qwen3)
    expand_turns: bool = False  # --expand-turns: one example per target assistant turn

    def __post_init__(self) -> None:
        object.__setattr__(self, "mixture", self.mixture or Mixture.single(self.inputs, self.format, self.template_options))

    @property
    def template_kwargs(self) -> dict[str, str]:
        return dict(self.template_options)

    @property
    def preference(self) -> bool:
        """A preference set (format `preference`): each example a pair of two sides, rows of format 5 or 6."""
        from prepack.text.formats import template_class, template_names

        names = template_names()  # `auto` is no format yet: the launcher resolves it from the records
        return any(s.format in names and template_class(s.format).yields_preference for s in self.mixture.sources)

    @property
    def cuts_pieces(self) -> bool:
        """--overlong split or window: an example may become several pieces, so rows carry
        `example_targets` (row format 3, or 4 with a mixture; docs/row_format.md)."""
        return self.overlong in (OverlongPolicy.SPLIT, OverlongPolicy.WINDOW)

    def manifest_options(self) -> dict[str, Any]:
        """The options recorded in each manifest. The output path, run id and Beam options are
        not in a RowSpec, so the manifest stays byte-identical across worker counts and folders."""
        return {
            "format": self.format,
            "template_options": self.template_kwargs,
            "chat_format": self.chat_format,
            "tokenizer": self.tokenizer,
            "max_lengths": list(self.max_lengths),
            "packing": "bfd" if self.pack else "unpacked",
            "overlong": self.overlong.value,
            # Only under window, so manifests of the other policies stay as they were; null: L // 4.
            **({"window_context_tokens": self.window_context_tokens} if self.overlong is OverlongPolicy.WINDOW else {}),
            "planner": self.planner.value,
            "max_segments_per_row": self.max_segments_per_row,
            "num_shards": self.num_shards,
            "target_shard_mb": self.target_shard_mb,
            "max_bad_fraction": self.max_bad_fraction,
            "sub_buckets": self.sub_buckets,
            "tfds_data_dir": self.tfds_data_dir,
            "max_record_bytes": self.limits.max_record_bytes,
            # Only when off, so manifests of runs without reasoning traces stay as they were.
            **({} if self.train_reasoning else {"train_reasoning": "no"}),
            **({"expand_turns": True} if self.expand_turns else {}),
        }


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How this run behaves: where it publishes, what it may replace or clean, its lock, its
    logs, and what it checks before publishing. None of it changes a byte of the rows."""

    output: str
    overwrite: bool = False
    clean_stale: bool = False  # remove leftovers of earlier killed runs
    lock_expiry_s: float = DEFAULT_EXPIRY_S  # a gs:// output lock not renewed for this long is stale
    batch_size: int = DEFAULT_TOKENIZE_BATCH_SIZE  # records per element after reading; also the encode_batch size
    progress: bool = True
    verbose: bool = False  # Beam's and the workers' full logs, also after Ctrl-C
    write_tokens: bool = True  # also publish OUTPUT/tokens (the tokenized set)
    from_tokens: str | None = None  # read the examples from this tokenized set instead of the inputs
    # --from-tokens: the token choices (prepack.format.tokenset.TOKEN_CHOICES) the user gave, to be
    # checked against the tokenized set's; the RowSpec's then come from the set.
    requested: tuple[tuple[str, Any], ...] = ()
    allow_short_mix: bool = False  # publish a mixture whose realized shares miss the requested ones
    allow_untrained_eot: bool = False  # publish although some target turns do not train their end-of-turn token


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """The job's config: what makes the rows, and how this run behaves."""

    rows: RowSpec
    run: RunOptions
