"""The stop-token check: every target assistant turn must train the token that ends it.

A reply whose end-of-turn token is not a target teaches the model to write the reply but never
to stop (TRL #5988, MaxText #4406). The built-in chat formats always put that token in the
loss; a user's jinja template (chat format `hf`) may not, so the job checks every example it
tokenizes. A target turn is a maximal run of loss-1 tokens (prepack/text/chat/: the reply and the
token that closes it, nothing else); its last token must be one of the format's end-of-turn
ids (`ChatFormat.end_of_turn_ids`: its own turn closer and the tokenizer's eos).

The same pass reports a trained *empty* think block (`<think>` then only whitespace, then
`</think>`, all targets): a model trained on those learns to skip its reasoning, which is what
fw-ai/cookbook #386 saw on about half of the replies after such training.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["StopTokenCheck", "StopFindings"]


@dataclass(frozen=True)
class StopFindings:
    """Per example of a batch: target turns whose last token is not an end of turn, and
    trained empty think blocks."""

    turns_without_trained_eot: np.ndarray  # int64, one count per example
    trained_empty_think: np.ndarray  # int64, one count per example


@dataclass(frozen=True)
class StopTokenCheck:
    end_of_turn_ids: frozenset[int]
    think_id: int | None = None
    end_think_id: int | None = None
    blank_ids: frozenset[int] = frozenset()  # ids whose text is only whitespace (between think markers)

    @classmethod
    def for_format(cls, chat_format) -> "StopTokenCheck":
        tok = chat_format.tokenizer
        think, end_think = tok.token_to_id("<think>"), tok.token_to_id("</think>")
        blank: set[int] = set()
        if think is not None and end_think is not None:
            for text in ("\n", "\n\n", " ", "  ", "\n\n\n", " \n", "\n "):
                blank.update(tok.encode(text))
        return cls(frozenset(chat_format.end_of_turn_ids()), think, end_think, frozenset(blank))

    def findings(self, lens: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> StopFindings:
        """lens: example lengths; ids, mask: the examples' tokens and loss masks concatenated."""
        lens = np.asarray(lens, dtype=np.int64)
        ids = np.asarray(ids)
        on = np.asarray(mask).astype(bool)
        n = len(ids)
        ends = np.cumsum(lens)
        # A run of targets ends at t when t is a target and t+1 is not, or t is its example's last token.
        last_of_example = np.zeros(n, dtype=bool)
        last_of_example[ends[lens > 0] - 1] = True
        next_off = np.ones(n, dtype=bool)
        next_off[:-1] = ~on[1:]
        run_end = np.flatnonzero(on & (next_off | last_of_example))
        eot = np.fromiter(self.end_of_turn_ids, dtype=np.int64, count=len(self.end_of_turn_ids))
        bad = run_end[~np.isin(ids[run_end], eot)]
        untrained = np.bincount(np.searchsorted(ends, bad, side="right"), minlength=len(lens))[: len(lens)]
        return StopFindings(untrained.astype(np.int64), self._empty_think(ids, on, ends, len(lens)))

    def _empty_think(self, ids: np.ndarray, on: np.ndarray, ends: np.ndarray, count: int) -> np.ndarray:
        out = np.zeros(count, dtype=np.int64)
        if self.think_id is None or self.end_think_id is None:
            return out
        for p in np.flatnonzero(on & (ids == self.think_id)).tolist():
            example = int(np.searchsorted(ends, p, side="right"))
            q = p + 1
            while q < ends[example] and int(ids[q]) in self.blank_ids and on[q]:
                q += 1
            if q < ends[example] and on[q] and int(ids[q]) == self.end_think_id:
                out[example] += 1
        return out
