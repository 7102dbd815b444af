"""Tokenizing a batch of examples with one chat format: one `encode_batch` call for all the text
pieces of the batch, stitched back together; and the single-turn fast path (`tokenize_prompt_responses_flat`),
which lays out a batch of prompt/response pairs with whole-array operations."""
from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from prepack.text.chat.base import ChatFormat, ChatFormatError, Segment, TokenizedExample
from prepack.text.chat.registry import get_chat_format
from prepack.text.conversation import Conversation, Document, PreferencePair

if TYPE_CHECKING:
    from prepack.text.tokenizer import Tokenizer

__all__ = ["tokenize_conversations", "tokenize_conversations_flat", "tokenize_prompt_responses_flat", "tokenize_preference_pairs"]


# Formats built from a name inside tokenize_conversations, so that passing a name per batch
# does not redo special-token lookups each time. Keyed by tokenizer identity.
_FORMAT_CACHE: dict[tuple[str, int], ChatFormat] = {}


def _resolve_format(chat_format: "ChatFormat | str", tokenizer: "Tokenizer") -> ChatFormat:
    if isinstance(chat_format, ChatFormat):
        if chat_format.tokenizer is not tokenizer:
            raise ValueError("tokenize_conversations: chat_format was built for a different tokenizer object")
        return chat_format
    key = (chat_format, id(tokenizer))
    fmt = _FORMAT_CACHE.get(key)
    if fmt is None or fmt.tokenizer is not tokenizer:
        if len(_FORMAT_CACHE) >= 16:
            _FORMAT_CACHE.clear()
        fmt = _FORMAT_CACHE[key] = get_chat_format(chat_format, tokenizer)
    return fmt


def tokenize_conversations(
    convs: Sequence[Conversation | Document], tokenizer: "Tokenizer", chat_format: "ChatFormat | str"
) -> list[TokenizedExample]:
    """Tokenize a batch of conversations with one tokenizer.encode_batch call.

    chat_format: a ChatFormat built for `tokenizer`, or a name (see get_chat_format).
    A ChatFormatError about one conversation carries its batch position in `.index`, so a
    caller can retry the others one by one and count the bad one.

    The returned arrays are views into one buffer per batch (one allocation instead of
    two per example); pickling a view stores only its own elements.
    """
    flat = tokenize_conversations_flat(convs, tokenizer, chat_format)
    if flat is None:
        return []
    input_ids, loss_mask, ends = flat
    out: list[TokenizedExample] = []
    start = 0
    for end in ends:
        out.append(TokenizedExample(input_ids[start:end], loss_mask[start:end]))
        start = end
    return out


def tokenize_conversations_flat(
    convs: Sequence[Conversation | Document], tokenizer: "Tokenizer", chat_format: "ChatFormat | str"
) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """tokenize_conversations without the per-example objects: (input_ids int32, loss_mask
    uint8, ends) for the whole batch, conversation k being [ends[k-1], ends[k]); None for an
    empty batch. Same ids, masks and errors as tokenize_conversations."""
    fmt = _resolve_format(chat_format, tokenizer)
    segments, document_segments = fmt.segments, fmt.document_segments
    all_segs: list[Segment] = []
    seg_counts: list[int] = []
    add_count = seg_counts.append
    for index, conv in enumerate(convs):
        try:
            segs = document_segments(conv) if conv.__class__ is Document else segments(conv)
        except ChatFormatError as exc:
            raise ChatFormatError(exc.reason, exc.message, index) from exc
        add_count(len(segs))
        all_segs += segs
    if not seg_counts:
        return None

    # Per-segment work in C where possible: unzip, find the non-empty texts, encode them in one
    # call and put their ids in place; an empty text stays "" and counts 0 tokens.
    if all_segs:
        payloads_t, masks = zip(*all_segs)
        payloads: list[Any] = list(payloads_t)
    else:
        payloads, masks = [], ()
    text_pos = [i for i, p in enumerate(payloads) if p.__class__ is str and p]
    if text_pos:
        encoded = tokenizer.encode_batch([payloads[i] for i in text_pos])
        for i, ids in zip(text_pos, encoded):
            payloads[i] = ids
    lengths = list(map(len, payloads))
    input_ids = np.fromiter(chain.from_iterable(payloads), dtype=np.int32, count=sum(lengths))
    loss_mask = np.repeat(np.array(masks, dtype=np.uint8), lengths)
    # Token offset where each conversation ends: cumulative tokens at its last segment.
    seg_ends = np.cumsum(np.array(seg_counts, dtype=np.int64)) - 1
    tok_cum = np.cumsum(np.array(lengths, dtype=np.int64))
    ends = tok_cum[seg_ends].tolist()
    return input_ids, loss_mask, ends


def tokenize_prompt_responses_flat(
    prompts: Sequence[str], responses: Sequence[str], tokenizer: "Tokenizer", chat_format: "ChatFormat | str"
) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """tokenize_conversations_flat for single-turn examples given as prompt and response
    texts: the same ids, masks and ends as for their Conversations, without building them.
    None for an empty batch. Raises ValueError for a format without a pair layout."""
    fmt = _resolve_format(chat_format, tokenizer)
    layout = fmt.prompt_response_layout()
    if layout is None:
        raise ValueError(f"chat format {fmt.name!r} has no single-turn layout; use tokenize_conversations_flat")
    n = len(prompts)
    if n != len(responses):
        raise ValueError(f"{n} prompts but {len(responses)} responses")
    if not n:
        return None
    prefix = layout.prompt_prefix
    if layout.strip:
        texts = [prefix + p.strip() for p in prompts]
        texts += [r.strip() for r in responses]
    else:
        texts = [prefix + p for p in prompts]
        chars = layout.response_lstrip
        texts += [r.lstrip(chars) for r in responses] if chars else responses
    # segments() leaves an empty text unencoded (0 tokens); encode_batch is not asked about "".
    if "" in texts:
        encoded = [[] for _ in texts]
        nonempty = [i for i, t in enumerate(texts) if t]
        for i, ids in zip(nonempty, tokenizer.encode_batch([texts[i] for i in nonempty])):
            encoded[i] = ids
    else:
        encoded = tokenizer.encode_batch(texts)
    lits = (layout.before_prompt, layout.between, layout.after_response, layout.closing)
    # [n, 6] segment lengths in segment order; literal columns are constants.
    seg_lens = np.empty((n, 6), dtype=np.int64)
    seg_lens[:, 0], seg_lens[:, 2], seg_lens[:, 4], seg_lens[:, 5] = (len(x) for x in lits)
    seg_lens[:, 1] = np.fromiter(map(len, encoded[:n]), dtype=np.int64, count=n)
    seg_lens[:, 3] = np.fromiter(map(len, encoded[n:]), dtype=np.int64, count=n)
    seg_starts = (np.cumsum(seg_lens.ravel()) - seg_lens.ravel()).reshape(n, 6)
    total = int(seg_lens.sum())
    input_ids = np.empty(total, dtype=np.int32)
    for col, encoded_part in ((1, encoded[:n]), (3, encoded[n:])):
        lens = seg_lens[:, col]
        count = int(lens.sum())
        # Each token's flat position: its segment's start plus its index within the segment.
        within = np.arange(count, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        input_ids[np.repeat(seg_starts[:, col], lens) + within] = np.fromiter(
            chain.from_iterable(encoded_part), dtype=np.int32, count=count)
    for col, lit in zip((0, 2, 4, 5), lits):
        if lit:
            input_ids[seg_starts[:, col, None] + np.arange(len(lit))] = np.asarray(lit, dtype=np.int32)
    loss_mask = np.repeat(np.tile(np.array([0, 0, 0, 1, 1, 0], dtype=np.uint8), n), seg_lens.ravel())
    ends = (seg_starts[:, 5] + seg_lens[:, 5]).tolist()
    return input_ids, loss_mask, ends


# --------------------------------------------------------------------------------------
# Preference pairs
# --------------------------------------------------------------------------------------


def tokenize_preference_pairs(
    pairs: Sequence[PreferencePair], tokenizer: "Tokenizer", chat_format: "ChatFormat | str"
) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray] | None:
    """Each pair as one example, its chosen side's tokens then its rejected side's (prepack/packing/
    pairs.py): (input_ids, loss_mask, ends, bounds [pairs, 2] = (prompt, split)). The prompt is the
    tokens before each side's first target, which must be the same ids on both sides (a chat
    format renders the shared turns alike): ChatFormatError `pair_prompts_differ`, with the pair's
    batch position, otherwise; a side the chat format cannot lay out raises its ChatFormatError with
    the pair's position too. None for an empty batch."""
    sides = [side for pair in pairs for side in (pair.chosen, pair.rejected)]
    try:
        flat = tokenize_conversations_flat(sides, tokenizer, chat_format)
    except ChatFormatError as exc:
        if exc.index is None:
            raise
        # Its index counts sides; the caller drops examples, and a pair is one: the pair's position.
        raise ChatFormatError(exc.reason, exc.message, exc.index // 2) from exc
    if flat is None:
        return None
    ids, mask, side_ends = flat
    ends = np.asarray(side_ends, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    bounds = np.zeros((len(pairs), 2), dtype=np.int32)
    for j in range(len(pairs)):
        c0, c1, r0, r1 = int(starts[2 * j]), int(ends[2 * j]), int(starts[2 * j + 1]), int(ends[2 * j + 1])
        prompt_c = int(np.argmax(mask[c0:c1] != 0)) if mask[c0:c1].any() else c1 - c0
        prompt_r = int(np.argmax(mask[r0:r1] != 0)) if mask[r0:r1].any() else r1 - r0
        if prompt_c != prompt_r or not np.array_equal(ids[c0:c0 + prompt_c], ids[r0:r0 + prompt_r]):
            raise ChatFormatError("pair_prompts_differ", "the chat format renders the prompt differently before the chosen "
                                  f"and the rejected reply ({prompt_c} and {prompt_r} tokens before the first target); a "
                                  "pair's sides must start with the same tokens", j)
        bounds[j] = (prompt_c, c1 - c0)
    return ids, mask, ends[1::2].tolist(), bounds
