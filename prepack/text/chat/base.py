"""What every chat format shares: the segment model, the error type, and the base class.

A chat format lays out an example (prepack/text/conversation.py) as a list of *segments*: either
a piece of plain text (encoded by the tokenizer) or literal token ids (special tokens such as
<start_of_turn> or <tool_call>, inserted by id so that data can never forge them), each with a
loss flag. prepack/text/chat/batch.py encodes the text pieces of a whole batch with one
`encode_batch` call and stitches the ids back together.

Loss mask rule (all formats): 1 on what the model writes in each target assistant turn (its
text, its tool calls, and the end-of-turn token that closes it), 0 everywhere else (BOS, role
headers, system and user turns, tools, tool results, non-target assistant turns, the newline
after end-of-turn). The mask is aligned to input_ids (not shifted): mask[t] == 1 means "token t
is predicted".

Text between two special tokens is encoded as ONE piece, as a tokenizer does on the whole
rendered string (Hugging Face tokenizers split on added tokens first, then encode each run of
text): that is what makes a layout id-for-id equal to the model's own template. A target's text
is its own piece, starting right after the header the model is prompted with.

A plain-text `Document` has no chat markup in any format (`document_segments`): BOS when the
tokenizer has one, the text, and the tokenizer's eos, every token a target but the first.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from prepack.text.conversation import Conversation, Document
from prepack.text.tool_markup import FUNCTIONGEMMA_RESPONSE

if TYPE_CHECKING:  # the Tokenizer protocol lives in prepack.text.tokenizer (see docs/CONTRACTS.md)
    from prepack.text.tokenizer import Tokenizer

__all__ = ["Segment", "TokenizedExample", "ChatFormatError", "CHAT_FORMAT_ERROR_REASONS", "CHAT_FORMAT_ERROR_ADVICE", "ChatFormat",
           "PromptResponseLayout", "END_OF_TURN_TOKENS"]

# A segment: (text to encode | literal token ids, loss flag 0/1).
Segment = tuple[Union[str, tuple[int, ...]], int]


@dataclass(frozen=True, slots=True)
class TokenizedExample:
    """One training example: token ids and a 0/1 loss mask of the same length."""

    input_ids: np.ndarray  # int32, shape [n]
    loss_mask: np.ndarray  # uint8 0/1, shape [n]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


class ChatFormatError(Exception):
    """A chat format cannot be built for a tokenizer, or cannot lay out a conversation.

    reason: short stable code (see CHAT_FORMAT_ERROR_REASONS);
    index:  position of the conversation in the batch given to tokenize_conversations,
            or None when the error is not about one conversation.
    """

    def __init__(self, reason: str, message: str, index: int | None = None) -> None:
        super().__init__(message if index is None else f"conversation {index} of the batch: {message}")
        self.reason = reason
        self.message = message
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, self.message, self.index))


CHAT_FORMAT_ERROR_REASONS: tuple[str, ...] = (
    "unknown_chat_format",         # get_chat_format(name) with a name not in chat_format_names()
    "missing_special_token",       # the tokenizer lacks a token the format needs (<start_of_turn>, <|im_start|>, ...)
    "no_bos",                      # gemma needs tokenizer.bos_id
    "no_chat_template",            # hf format, tokenizer.chat_template is None/empty
    "no_format_detected",          # auto found neither a template nor gemma/chatml tokens
    "system_not_first",            # gemma: a system turn that is not the first turn
    "system_without_user",         # gemma: the system turn is not followed by a user turn to prepend it to
    "template_error",              # hf: the jinja template raised (e.g. roles must alternate)
    "template_not_prefix_stable",  # hf: rendering a shorter conversation is not a prefix of the longer one
    "empty_target",                # hf: the template rendered nothing for a target assistant turn
    "special_token_in_text",       # hf: message text spells a special token (it would be parsed as one)
    "reasoning_not_supported",     # gemma, chatml: a turn carries reasoning_content, and the format has no think block
    "tools_not_supported",         # gemma: tools, tool calls or tool results, and Gemma 3 has no tool tokens
    "pair_prompts_differ",         # a preference pair whose two sides do not start with the same prompt tokens
)

# What to do about a whole dataset refused for one of these reasons: said once in the job's
# failure line, beside the count (prepack/packing/bad_records.py).
CHAT_FORMAT_ERROR_ADVICE: dict[str, str] = {
    "tools_not_supported": "Gemma 3 has no tool tokens: pack tool calls with --chat-format hf and the model's own "
                           "tokenizer and template (e.g. FunctionGemma's: --tokenizer hf:google/functiongemma-270m-it), "
                           "or --tokenizer qwen3",
    "reasoning_not_supported": "use --chat-format qwen3 (with --tokenizer qwen3) for reasoning traces, or remove them",
    "template_not_prefix_stable": "the tokenizer's template rewrites earlier turns; use --chat-format gemma, chatml or qwen3",
}

# End-of-turn tokens of common chat templates: Gemma, ChatML/Qwen, Llama 3 (and its tool-call
# turn's <|eom_id|>), Phi-3, and FunctionGemma's stop after a call (<start_function_response>).
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", FUNCTIONGEMMA_RESPONSE[0])


class ChatFormat:
    """Lays out examples for one tokenizer. Build once (via get_chat_format) and reuse:
    construction looks up special tokens and caches the ids of constant header texts."""

    name: str = ""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self.tokenizer = tokenizer
        self._const_cache: dict[str, tuple[int, ...]] = {}
        bos, eos = tokenizer.bos_id, tokenizer.eos_id
        # Token strings of the special ids the format inserts (render writes them as such).
        self._special_text: dict[int, str] = {int(i): tokenizer.id_to_token(int(i)) for i in (bos, eos) if i is not None}
        self._doc_open: tuple[int, ...] = () if bos is None else (int(bos),)
        self._doc_close: tuple[int, ...] = () if eos is None else (int(eos),)
        self._decode_map: tuple[int, dict[int, str]] | None = None  # decode()'s specials, built on first use

    def segments(self, conv: Conversation) -> list[Segment]:
        raise NotImplementedError

    def document_segments(self, doc: Document) -> list[Segment]:
        """A plain text: [BOS] text [eos], the text and eos targets (the row builder zeroes the
        segment's first token, so without a BOS the text's first token is no target)."""
        segs: list[Segment] = [(self._doc_open, 0)] if self._doc_open else []
        segs.append((doc.text, 1))
        if self._doc_close:
            segs.append((self._doc_close, 1))
        return segs

    def render(self, example: Conversation | Document) -> str:
        """The full text of the example, special tokens written as their token strings: what
        decode() of its ids gives."""
        segs = self.document_segments(example) if isinstance(example, Document) else self.segments(example)
        return "".join(payload if isinstance(payload, str) else self.decode(payload) for payload, _ in segs)

    def decode(self, ids: "Sequence[int] | np.ndarray") -> str:
        """Token ids as text, every special token written as its token string (the format's own,
        e.g. <start_of_turn> or <tool_call>, and the tokenizer's named ones), the runs between
        them decoded by the tokenizer: a completion and its reference compare as text, and a
        tool-call parser finds the markup a tokenizer's plain decode would drop (Gemma's does)."""
        specials = self._decode_specials()
        out: list[str] = []
        plain: list[int] = []
        for token_id in (ids.tolist() if isinstance(ids, np.ndarray) else ids):
            text = specials.get(int(token_id))
            if text is None:
                plain.append(int(token_id))
                continue
            if plain:
                out.append(self.tokenizer.decode(plain))
                plain = []
            out.append(text)
        if plain:
            out.append(self.tokenizer.decode(plain))
        return "".join(out)

    def _decode_specials(self) -> dict[int, str]:
        """id -> token string of every special token decode() writes out. The format's own set
        grows as it meets tool tokens, so the map is rebuilt when that set has grown."""
        cached = self._decode_map
        if cached is None or cached[0] != len(self._special_text):
            named = getattr(self.tokenizer, "special_ids", None)
            named = named() if callable(named) else named
            if not isinstance(named, dict):
                named = (self.tokenizer.identity().get("special_ids") or {}) if hasattr(self.tokenizer, "identity") else {}
            mapping = {int(i): str(t) for t, i in named.items() if isinstance(i, int) and str(t).strip()}
            mapping.update(self._extra_specials())
            mapping.update(self._special_text)
            cached = (len(self._special_text), mapping)
            self._decode_map = cached
        return cached[1]

    def _extra_specials(self) -> dict[int, str]:
        """More special tokens a format knows (hf: those its template spells)."""
        return {}

    def prompt_response_layout(self) -> "PromptResponseLayout | None":
        """How segments() lays out one user turn followed by one target assistant turn, for
        tokenize_prompt_responses_flat (prepack/text/chat/batch.py); None when the format has no fixed
        layout (the jinja format)."""
        return None

    def end_of_turn_ids(self) -> frozenset[int]:
        """Ids that may close a target assistant turn (the stop-token check, prepack.text.stop_check):
        the tokenizer's eos and whichever well-known end-of-turn tokens it has."""
        tok = self.tokenizer
        found = {tok.token_to_id(t) for t in END_OF_TURN_TOKENS}
        if tok.eos_id is not None:
            found.add(int(tok.eos_id))
        return frozenset(i for i in found if i is not None)

    # -- helpers ------------------------------------------------------------------------

    def _const(self, text: str) -> tuple[int, ...]:
        """Ids of a constant text (role headers, newline), encoded once."""
        ids = self._const_cache.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text))
            self._const_cache[text] = ids
        return ids

    def _special(self, token: str) -> int:
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise ChatFormatError(
                "missing_special_token",
                f"chat format {self.name!r} needs the token {token!r}, but tokenizer "
                f"{getattr(self.tokenizer, 'name', '?')!r} does not have it; pick a chat format that "
                f"matches the tokenizer (or 'auto')",
            )
        self._special_text[tid] = token
        return tid

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id)

    def _refuse_reasoning(self, conv: Conversation) -> None:
        """Formats without think tokens cannot lay out a reasoning trace; dropping it silently
        would train the reply without what it was reasoned from."""
        for i, turn in enumerate(conv.turns):
            if turn.reasoning is not None:
                raise ChatFormatError(
                    "reasoning_not_supported",
                    f"turn {i} (assistant) carries field 'reasoning_content', but chat format {self.name!r} has no think "
                    f"block to put it in; use --chat-format qwen3 (with --tokenizer qwen3) or remove the field")


@dataclass(frozen=True)
class PromptResponseLayout:
    """What segments() gives for [user(prompt), assistant(response)] with loss on the reply:

        (before_prompt, 0) (prompt_prefix + prompt, 0) (between, 0) (response, 1)
        (after_response, 1) (closing, 0)

    prompt and response trimmed when `strip`; the response's leading `response_lstrip`
    characters removed (qwen3 drops newlines before the reply, as its template does). Only the
    two texts vary per example, so a batch of pairs is laid out with whole-array operations
    instead of per-segment Python. tests/test_templates.py checks it against segments() for
    every format that has one.
    """

    before_prompt: tuple[int, ...]
    prompt_prefix: str
    between: tuple[int, ...]
    after_response: tuple[int, ...]
    closing: tuple[int, ...]
    strip: bool
    response_lstrip: str = ""
