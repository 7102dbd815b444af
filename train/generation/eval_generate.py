"""`prepack train --eval-generate FILE --eval-generate-every N`: a few held-out prompts generated
and scored during the run, as `prepack generate --score` scores them.

FILE holds records in the shard set's own source format; they are rendered with the tokenizer,
chat format and options its manifest records (`--columns`/`--roles` included), so the prompts are
the training rendering (prepack/text/chat/prompts.py): the last target turn of each example, made
by `prepack generate`'s own path from records to prompts (train/generation/generations.py example_prompts).
`prepare` reads and renders them before any weights load (a bad FILE stops the run at once);
the evaluator generates greedily with the run's own model (train/generation/generate.py's view of it: the
LoRA values of the step, Tunix's attention) before the first step, every N steps, and after the
last. Each evaluation is one metrics JSONL line,

    {"eval_generate": {"step", "prompts", "exact_match", "reference_nll", "valid_call_rate", ...,
                       "completion_tokens_mean", "time_s"}}

and a console line; its time is not charged to the next step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from train.run_config.config import TrainConfig, TrainError
from train.run_config.options import whole_number

MAX_PROMPTS = 256  # "a few": a run's evaluations must stay a small part of it
EXTRA_NEW_TOKENS = 16  # generated past the longest reference, to see a reply that does not stop


@dataclasses.dataclass
class Prompts:
    items: list[Any]  # train.generation.generations.PromptItem
    tokenizer: Any
    chat_format: Any
    parser: str | None
    max_new_tokens: int
    skipped: int  # records that held no usable example (said once)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`prepack train`'s --eval-generate options."""
    p.add_argument("--eval-generate", metavar="FILE",
                   help="held-out records (a JSONL in the shard set's format): their last replies generated and scored "
                   "(exact match, reference NLL, tool calls; as prepack generate --score) before the first step, every "
                   "--eval-generate-every steps and after the last, into the metrics JSONL")
    p.add_argument("--eval-generate-every", type=whole_number("--eval-generate-every"), metavar="N", help="with --eval-generate: every N steps too")


def check_flags(cfg: TrainConfig) -> None:
    if cfg.eval_generate_every is not None:
        if cfg.eval_generate is None:
            raise TrainError("--eval-generate-every needs --eval-generate FILE (the held-out records to generate for)")


def _records(path: str) -> list[Any]:
    from prepack import storage

    try:
        text = storage.read_text(path)
    except Exception as e:  # noqa: BLE001 - a file another tool wrote; one line
        raise TrainError(f"--eval-generate {path}: cannot be read ({type(e).__name__}: {e})") from None
    if text is None:
        raise TrainError(f"--eval-generate {path}: no such file")
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as e:
            raise TrainError(f"--eval-generate {path}:{number}: not a JSON line ({e}); give a JSONL of records in "
                             "the shard set's format") from None
    return records


def prepare(cfg: TrainConfig, manifest: Any, out: TextIO | None = None) -> Prompts:
    """FILE's prompts, rendered as the shard set was; TrainError (one line) when it has none."""
    from prepack.packing.accounting import Tally
    from prepack.text.chat import ChatFormatError, get_chat_format, tool_calls
    from prepack.text.formats import ResolvedFormat
    from prepack.text.tokenizer import TokenizerError, load_tokenizer
    from train.generation import generations

    path = str(cfg.eval_generate)
    options = manifest.options or {}
    fmt = options.get("format")
    if not isinstance(fmt, str) or fmt in ("mixture", "text", "preference"):
        raise TrainError(f"--eval-generate needs a shard set packed from one chat or instruction format; {cfg.shards} "
                         f"was packed from {fmt!r}: score it afterwards with prepack generate --score")
    try:
        tokenizer = load_tokenizer(str(options.get("tokenizer") or manifest.tokenizer.get("name")))
        chat_format = get_chat_format(str(manifest.template.get("chat_format_resolved") or options.get("chat_format")),
                                      tokenizer, options.get("train_reasoning", "yes") != "no")
        # The format the set recorded, resolved when it was packed: built from that record.
        template = ResolvedFormat(fmt, tuple((k, str(v)) for k, v in (options.get("template_options") or {}).items())).build()
    except (TokenizerError, ChatFormatError, ValueError) as e:
        raise TrainError(f"--eval-generate: the shard set's tokenizer and format cannot be rebuilt: {e}") from None
    records = _records(path)
    preparer = _preparer(path, template, tokenizer, chat_format, bool(options.get("expand_turns")))
    tally, bad = Tally(), []
    items, has_tools = generations.example_prompts(preparer, _examples(preparer, records, tally, bad), tally, bad)
    if not items:
        raise TrainError(f"--eval-generate {path}: none of its {len(records)} records makes a prompt in the shard set's "
                         f"format {fmt!r} (with {tokenizer.name}, chat format {chat_format.name})")
    if len(items) > MAX_PROMPTS:
        raise TrainError(f"--eval-generate {path}: {len(items)} prompts; give at most {MAX_PROMPTS} (it runs during "
                         "training), or score a larger set afterwards with prepack generate --score")
    parser = tool_calls.default_parser(chat_format.name, getattr(chat_format, "chat_template", None)) if has_tools else None
    skipped = len(bad)  # each a record the format refused or an example that makes no prompt
    if skipped:
        print(f"--eval-generate {path}: {skipped} of its records make no prompt (not in format {fmt!r}); "
              f"scoring {len(items)} prompts", file=out if out is not None else sys.stderr)
    longest = max(len(item.reference_ids) for item in items)
    return Prompts(items, tokenizer, chat_format, parser, longest + EXTRA_NEW_TOKENS, skipped)


def _preparer(path: str, template: Any, tokenizer: Any, chat_format: Any, expand_turns: bool) -> Any:
    """The job's prepare stage (pipelines/preparer.py) for FILE's records, as one task."""
    from pipelines.preparer import Preparer
    from pipelines.wire.records import TaskMeta

    return Preparer((TaskMeta(0, path, path, path),), template, tokenizer, chat_format, expand_turns=expand_turns)


def _examples(preparer: Any, records: list[Any], tally: Any, bad: list[Any]) -> Iterator[Any]:
    """FILE's records through the format, as the job templates them: (conv, response, meta)."""
    from pipelines.inputs.readers import RAW_OBJECT

    raw = [(index, index + 1, RAW_OBJECT, record) for index, record in enumerate(records)]
    yield from preparer.template_records(0, raw, tally, bad).items()


class Evaluator:
    """Generates and scores the prompts with a run's model; `every(stream)` evaluates as training goes."""

    def __init__(self, setup: Any, prompts: Prompts, every: int | None, out: TextIO | None = None):
        from train.generation import generate

        self.setup, self.prompts, self.every = setup, prompts, every
        self.out = out if out is not None else sys.stderr
        self.compute = setup.run.compute_dtype  # train/resolved_run.py
        self.generator = generate.Generator(
            setup.built.model, pad_id=prompts.tokenizer.pad_id, stop_ids=sorted(prompts.chat_format.end_of_turn_ids()),
            max_prompt_tokens=max(len(i.prompt_ids) for i in prompts.items),
            sampling=generate.SamplingOptions(max_new_tokens=prompts.max_new_tokens, batch_size=min(8, len(prompts.items))),
            compute_dtype=self.compute, out=self.out)
        from train.verification.parity import Scorer

        # One scorer of the generation view, whose LoRA each refresh updates in place: compiled once.
        self.scorer = Scorer(self.generator.view, "dense", self.compute)
        self.done_at: set[int] = set()

    def evaluate(self, step: int) -> dict[str, Any]:
        from train.generation import generate, generations
        from train.generation import score as score_lib

        started = time.perf_counter()
        self.generator.refresh(self.setup.built.model)
        gen = self.generator

        def nll(pairs: Any) -> list[tuple[float, int]]:
            return generate.reference_nll(gen.view, pairs, compute_dtype=self.compute, batch_size=gen.sampling.batch_size,
                                          scorer=self.scorer)

        lines = generations.run_items(self.prompts.items, gen, self.prompts.chat_format, score=True,
                                      parser=self.prompts.parser, nll=nll)
        summary = score_lib.summarize(lines, self.prompts.parser)
        record = {"step": step, **{k: summary[k] for k in ("prompts", "exact_match", "reference_nll", "valid_call_rate",
                                                           "function_name_accuracy", "full_call_accuracy", "no_call_accuracy",
                                                           "completion_tokens_mean")},
                  "time_s": time.perf_counter() - started}
        self.done_at.add(step)
        self.setup.recorder.eval_generate_done(record)
        return record

    def every_n(self, stream: Iterable[Any]) -> Iterator[Any]:
        """The training stream, evaluating when Tunix asks for the batch after every N-th step."""
        trainer = self.setup.trainer
        for batch in stream:
            step = int(trainer.train_steps)
            if self.every and step and step % self.every == 0 and step not in self.done_at:
                self.evaluate(step)
            yield batch

    def finish(self) -> None:
        """After the last step, unless that step was just evaluated."""
        step = int(self.setup.trainer.train_steps)
        if step not in self.done_at:
            self.evaluate(step)
