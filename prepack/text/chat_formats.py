"""Conversation + Tokenizer -> token ids and loss mask.

A chat format lays out a `Conversation` (prepack.text.templates) as a list of *segments*: either
a piece of plain text (encoded by the tokenizer) or literal token ids (special tokens such
as <start_of_turn>, inserted by id so that user text can never forge them), each with a
loss flag. `tokenize_conversations` collects the text pieces of a whole batch, encodes
them with ONE `tokenizer.encode_batch` call and stitches the ids back together; that
keeps the per-example Python work small next to the tokenizer itself.

Loss mask rule (all formats): 1 on the content tokens of each target assistant turn and on
the end-of-turn token that closes it, 0 everywhere else (BOS, role headers, prompts,
non-target assistant turns, and the newline after end-of-turn). The mask is aligned to
input_ids (not shifted): input_mask[t] == 1 means "token t is predicted".

Target content is always encoded as its own text piece, separate from the role header
before it. At inference the model generates the reply starting right after the header, so
this is exactly the tokenization it must learn to produce, and the mask boundary falls on a
token boundary by construction. Prompt text between two special tokens is encoded as one
piece, as the tokenizer would do on the whole rendered string.

Formats: gemma, chatml, qwen3 (ChatML with Qwen3's empty think block), hf (the tokenizer's own
jinja template), auto. See get_chat_format.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import numpy as np

from prepack.text.templates import Conversation

if TYPE_CHECKING:  # the Tokenizer protocol lives in prepack.text.tokenizer (see docs/CONTRACTS.md)
    from prepack.text.tokenizer import Tokenizer

__all__ = [
    "TokenizedExample",
    "ChatFormatError",
    "CHAT_FORMAT_ERROR_REASONS",
    "ChatFormat",
    "GemmaFormat",
    "ChatMLFormat",
    "Qwen3Format",
    "HFTemplateFormat",
    "get_chat_format",
    "chat_format_names",
    "tokenize_conversations",
    "tokenize_conversations_flat",
    "PairLayout",
    "tokenize_pairs_flat",
]

# A segment: (text to encode | literal token ids, loss flag 0/1).
Segment = tuple[Union[str, tuple[int, ...]], int]


@dataclass(frozen=True, slots=True)
class TokenizedExample:
    """One training example: token ids and a 0/1 loss mask of the same length."""

    input_ids: np.ndarray  # int32, shape [n]
    loss_mask: np.ndarray  # uint8 0/1, shape [n]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


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
)


# --------------------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------------------

# End-of-turn tokens of common chat templates (Gemma, ChatML/Qwen, Llama 3, Phi-3).
_END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")


class ChatFormat:
    """Lays out conversations for one tokenizer. Build once (via get_chat_format) and reuse:
    construction looks up special tokens and caches the ids of constant header texts."""

    name: str = ""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self.tokenizer = tokenizer
        self._const_cache: dict[str, tuple[int, ...]] = {}

    def segments(self, conv: Conversation) -> list[Segment]:
        raise NotImplementedError

    def render(self, conv: Conversation) -> str:
        """The full text of the example, special tokens written as their token strings.
        decode() of the ids (with special ids mapped back to their strings) gives this."""
        raise NotImplementedError

    def pair_layout(self) -> "PairLayout | None":
        """How segments() lays out one user turn followed by one target assistant turn, for
        tokenize_pairs_flat; None when the format has no fixed layout (the jinja format)."""
        return None

    def end_of_turn_ids(self) -> frozenset[int]:
        """Ids that may close a target assistant turn (the stop-token check, prepack.text.stop_check):
        the tokenizer's eos and whichever well-known end-of-turn tokens it has."""
        tok = self.tokenizer
        found = {tok.token_to_id(t) for t in _END_OF_TURN_TOKENS}
        if tok.eos_id is not None:
            found.add(int(tok.eos_id))
        return frozenset(i for i in found if i is not None)

    def tokenize(self, conv: Conversation) -> TokenizedExample:
        """One conversation; for throughput use tokenize_conversations on a batch."""
        return tokenize_conversations([conv], self.tokenizer, self)[0]

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


# --------------------------------------------------------------------------------------
# Gemma
# --------------------------------------------------------------------------------------


class GemmaFormat(ChatFormat):
    """<bos><start_of_turn>user\\n{user}<end_of_turn>\\n<start_of_turn>model\\n{reply}<end_of_turn>\\n...

    Mirrors Gemma's official chat template: BOS once at the start; a leading system turn is
    prepended to the first user turn followed by "\\n\\n"; user and assistant content is
    trimmed (the official template applies `| trim`), the system text is not.
    """

    name = "gemma"

    def __init__(self, tokenizer: "Tokenizer") -> None:
        super().__init__(tokenizer)
        # Turn markers first: a missing one says "wrong tokenizer for this format" most clearly.
        self.sot = self._special("<start_of_turn>")
        self.eot = self._special("<end_of_turn>")
        if tokenizer.bos_id is None:
            raise ChatFormatError("no_bos", f"chat format 'gemma' needs a BOS token, but tokenizer {getattr(tokenizer, 'name', '?')!r} has none")
        self.bos = int(tokenizer.bos_id)
        nl = self._const("\n")
        model_hdr = self._const("model\n")
        eot_nl = (self.eot, *nl)
        # Literal ids that open a turn, by what came before: start of the example (BOS),
        # a closed turn (<end_of_turn>\n), or a closed *target* turn whose <end_of_turn> was
        # already emitted with loss 1 (so only "\n" remains, with loss 0).
        self._open_user = {"start": (self.bos, self.sot), "closed": (*eot_nl, self.sot), "target": (*nl, self.sot)}
        self._open_model = {k: v + model_hdr for k, v in self._open_user.items()}
        self._close = {"start": (), "closed": eot_nl, "target": nl}
        self._eot_only = (self.eot,)

    def pair_layout(self) -> "PairLayout":
        return PairLayout(self._open_user["start"], "user\n", self._open_model["closed"], self._eot_only,
                          self._close["target"], strip=True)

    def segments(self, conv: Conversation) -> list[Segment]:
        self._refuse_reasoning(conv)
        turns = conv.turns
        loss = conv.loss_turns
        segs: list[Segment] = []
        append = segs.append
        state = "start"
        prefix = ""
        first = 0
        if turns and turns[0].role == "system":
            prefix = turns[0].content + "\n\n"
            first = 1
        for i in range(first, len(turns)):
            turn = turns[i]
            role = turn.role
            if role == "user":
                append((self._open_user[state], 0))
                append(("user\n" + prefix + turn.content.strip(), 0))
                prefix = ""
                state = "closed"
            elif role == "assistant":
                if prefix:
                    raise ChatFormatError("system_without_user", "gemma: the system turn must be followed by a user turn (it is prepended to it)")
                append((self._open_model[state], 0))
                if i in loss:
                    append((turn.content.strip(), 1))
                    append((self._eot_only, 1))
                    state = "target"
                else:
                    append((turn.content.strip(), 0))
                    state = "closed"
            else:
                raise ChatFormatError("system_not_first", f"gemma: a system turn is only supported as the first turn, found at turn {i}")
        if prefix:
            raise ChatFormatError("system_without_user", "gemma: the system turn must be followed by a user turn (it is prepended to it)")
        append((self._close[state], 0))
        return segs

    def render(self, conv: Conversation) -> str:
        self._refuse_reasoning(conv)
        sot, eot = self._token_str(self.sot), self._token_str(self.eot)
        out = [self._token_str(self.bos)]
        prefix = ""
        turns = conv.turns
        if turns and turns[0].role == "system":
            prefix, turns = turns[0].content + "\n\n", turns[1:]
        for turn in turns:
            word = "model" if turn.role == "assistant" else "user"
            out.append(f"{sot}{word}\n{prefix}{turn.content.strip()}{eot}\n")
            prefix = ""
        return "".join(out)


# --------------------------------------------------------------------------------------
# ChatML (Qwen)
# --------------------------------------------------------------------------------------


class ChatMLFormat(ChatFormat):
    """<|im_start|>{role}\\n{content}<|im_end|>\\n per turn, no BOS (Qwen has none), content
    verbatim. No default system prompt is injected. Target = reply + <|im_end|>."""

    name = "chatml"

    def __init__(self, tokenizer: "Tokenizer") -> None:
        super().__init__(tokenizer)
        self.ims = self._special("<|im_start|>")
        self.ime = self._special("<|im_end|>")
        nl = self._const("\n")
        asst_hdr = self._const("assistant\n")
        ime_nl = (self.ime, *nl)
        self._open = {"start": (self.ims,), "closed": (*ime_nl, self.ims), "target": (*nl, self.ims)}
        self._open_asst = {k: v + asst_hdr for k, v in self._open.items()}
        # The opener of the one assistant turn that _think_turn() picks (none in plain ChatML).
        self._open_think = self._open_asst
        self._close = {"start": (), "closed": ime_nl, "target": nl}
        self._ime_only = (self.ime,)

    def _think_turn(self, turns: Sequence[Any]) -> int:
        """Index of the assistant turn opened with self._open_think (-1: none)."""
        return -1

    def pair_layout(self) -> "PairLayout":
        return PairLayout(self._open["start"], "user\n", self._open_asst["closed"], self._ime_only,
                          self._close["target"], strip=False)

    def segments(self, conv: Conversation) -> list[Segment]:
        loss = conv.loss_turns
        segs: list[Segment] = []
        append = segs.append
        state = "start"
        think_at = self._think_turn(conv.turns)
        for i, turn in enumerate(conv.turns):
            if turn.role == "assistant":
                content = turn.content
                if turn.reasoning is not None:
                    content = self._reasoning_segments(conv, i, state, i in loss, segs)
                elif i == think_at:
                    append((self._open_think[state], 0))
                    content = content.lstrip("\n")
                else:
                    append((self._open_asst[state], 0))
                if i in loss:
                    append((content, 1))
                    append((self._ime_only, 1))
                    state = "target"
                    continue
                append((content, 0))
            else:
                append((self._open[state], 0))
                append((turn.role + "\n" + turn.content, 0))
            state = "closed"
        append((self._close[state], 0))
        return segs

    def render(self, conv: Conversation) -> str:
        ims, ime = self._token_str(self.ims), self._token_str(self.ime)
        think_at = self._think_turn(conv.turns)
        out = []
        for i, t in enumerate(conv.turns):
            if t.reasoning is not None:
                content = self._reasoning_text(conv, i) + t.content.lstrip("\n") if self._shows_reasoning(conv, i) else t.content
            else:
                content = self._think_str + t.content.lstrip("\n") if i == think_at else t.content
            out.append(f"{ims}{t.role}\n{content}{ime}\n")
        return "".join(out)

    _think_str = ""

    def _shows_reasoning(self, conv: Conversation, i: int) -> bool:
        self._refuse_reasoning(conv)
        return False

    def _reasoning_text(self, conv: Conversation, i: int) -> str:
        raise NotImplementedError

    def _reasoning_segments(self, conv: Conversation, i: int, state: str, target: bool, segs: list[Segment]) -> str:
        """Appends the opener of assistant turn i, which carries a reasoning trace, to `segs`
        and returns the content that follows it (plain ChatML refuses the trace)."""
        self._refuse_reasoning(conv)
        raise AssertionError("unreachable")


class Qwen3Format(ChatMLFormat):
    """ChatML as Qwen3's own chat template renders it for non-thinking SFT.

    Qwen3's template (Qwen/Qwen3-0.6B tokenizer_config.json) writes an assistant turn that
    comes after the last user turn and is the last message as
    `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n` + content.lstrip("\\n"), and every
    earlier assistant turn without a think block (it drops reasoning from history). With
    enable_thinking=False its generation prompt is exactly `<|im_start|>assistant\\n` followed
    by that empty think block, so the block is prompt (loss 0) here: the model never learns to
    emit it, only the reply and <|im_end|>. <think> and </think> go in by id, so a reply that
    spells them stays plain text (the template would split such a reply into reasoning; here
    content is never reinterpreted).
    """

    name = "qwen3"

    def __init__(self, tokenizer: "Tokenizer", train_reasoning: bool = True) -> None:
        super().__init__(tokenizer)
        think, end_think = self._special("<think>"), self._special("</think>")
        self.think, self.end_think, self.train_reasoning = think, end_think, train_reasoning
        nl2 = self._const("\n\n")
        self._nl2 = nl2
        block = (think, *nl2, end_think, *nl2)
        self._open_think = {k: v + block for k, v in self._open_asst.items()}
        self._think_str = f"{self._token_str(think)}\n\n{self._token_str(end_think)}\n\n"

    def _think_turn(self, turns: Sequence[Any]) -> int:
        last = len(turns) - 1
        if last < 0 or turns[last].role != "assistant":
            return -1
        for i in range(last - 1, -1, -1):
            if turns[i].role == "user":
                return last  # the last message, after the last user turn
        return -1  # no user turn: the template's last_query_index is the last message itself

    def pair_layout(self) -> "PairLayout":
        return PairLayout(self._open["start"], "user\n", self._open_think["closed"], self._ime_only,
                          self._close["target"], strip=False, response_lstrip="\n")

    # -- reasoning traces: as Qwen3's template writes an assistant message with reasoning_content:
    # after the last user message, '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' +
    # content.lstrip('\n'); before it (history), the content alone: the trace is dropped.

    def _shows_reasoning(self, conv: Conversation, i: int) -> bool:
        return not any(t.role == "user" for t in conv.turns[i + 1:])

    def _reasoning_text(self, conv: Conversation, i: int) -> str:
        trace = conv.turns[i].reasoning.strip("\n")  # type: ignore[union-attr]
        return f"{self._token_str(self.think)}\n{trace}\n{self._token_str(self.end_think)}\n\n"

    def _reasoning_segments(self, conv: Conversation, i: int, state: str, target: bool, segs: list[Segment]) -> str:
        turn = conv.turns[i]
        if not self._shows_reasoning(conv, i):
            segs.append((self._open_asst[state], 0))
            return turn.content
        trained = int(target and self.train_reasoning)
        segs.append((self._open_asst[state], 0))
        segs.append(((self.think,), trained))
        segs.append(("\n" + turn.reasoning.strip("\n") + "\n", trained))  # type: ignore[union-attr]
        segs.append(((self.end_think,), trained))
        content = turn.content.lstrip("\n")
        if trained:
            # The model writes the block and the reply in one go: "\n\n" + reply is one text, as
            # the tokenizer sees the rendered string. Returned as the target piece.
            return "\n\n" + content
        segs.append((self._nl2, 0))
        return content


# --------------------------------------------------------------------------------------
# The tokenizer's own jinja chat template
# --------------------------------------------------------------------------------------

# Strings in a template that look like special tokens: <...>, <|...|>, [INST]-style.
_TEMPLATE_TOKEN_RE = re.compile(r"<\|?[^<>\s{}|]{1,64}\|?>|\[/?[A-Za-z_]{1,32}\]")


class HFTemplateFormat(ChatFormat):
    """Renders with the tokenizer's jinja `chat_template` and derives the loss mask by
    rendering prefixes: for each target assistant turn i, render(messages[:i],
    add_generation_prompt=True) is the prompt side and render(messages[:i+1]) ends after the
    reply; the text in between is the target. Every shorter rendering must be a prefix of
    the longer ones ("prefix stable"), else ChatFormatError(template_not_prefix_stable);
    templates that rewrite history (e.g. strip earlier reasoning) are not supported.

    Whitespace after the last special token of a target (the "\\n" after <|im_end|>) gets
    loss 0, matching the rule for the built-in formats.

    Special tokens: `Tokenizer.encode` does not parse special-token strings (by contract),
    but rendered templates contain them. This class splits the rendered text on the
    tokenizer's special tokens itself and inserts their ids directly, so it works with any
    Tokenizer implementation. The set is: bos/eos/pad, `identity()["special_ids"]`, and every
    <...>-looking string in the template that the tokenizer knows as a single token but
    that plain encoding would not produce (i.e. an added/control token).

    Because of that split, a conversation whose text spells one of these special tokens
    is refused (ChatFormatError "special_token_in_text") rather than silently given a
    control id.

    Rendering: `tokenizer.apply_chat_template(messages, add_generation_prompt=...)` when the
    tokenizer offers one that returns a string, else transformers' jinja renderer on
    `tokenizer.chat_template` (transformers imported lazily), with bos_token/eos_token/
    pad_token/unk_token set from the tokenizer.
    """

    name = "hf"

    def __init__(self, tokenizer: "Tokenizer", chat_template: str | None = None) -> None:
        super().__init__(tokenizer)
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if not template:
            raise ChatFormatError(
                "no_chat_template",
                f"chat format 'hf' needs a chat template, but tokenizer {getattr(tokenizer, 'name', '?')!r} has none; "
                f"use chat format 'gemma' or 'chatml' (or 'auto', which picks one from the tokenizer's special tokens)",
            )
        self.chat_template: str = template
        self._own_template = chat_template is not None
        self.special_ids = self._collect_specials(template)
        alternation = "|".join(re.escape(t) for t in sorted(self.special_ids, key=len, reverse=True))
        # A capturing split alternates text, special, text, ...; with no specials, never splits.
        self._split_re = re.compile(f"({alternation})") if alternation else None
        self._render_kwargs: dict[str, str] | None = None
        self._use_tokenizer_apply: bool | None = None if not self._own_template else False

    # -- special tokens -------------------------------------------------------------------

    def _collect_specials(self, template: str) -> dict[str, int]:
        tok = self.tokenizer
        specials: dict[str, int] = {}
        for tid in (tok.bos_id, tok.eos_id, tok.pad_id):
            if tid is not None:
                specials[tok.id_to_token(int(tid))] = int(tid)
        # Prefer a direct `special_ids` mapping when the tokenizer has one (it avoids hashing
        # the vocabulary); else the contract's identity()["special_ids"].
        special_map: Any = getattr(tok, "special_ids", None)
        if callable(special_map):
            special_map = special_map()
        if not isinstance(special_map, dict):
            identity = getattr(tok, "identity", None)
            try:
                special_map = (identity().get("special_ids") if callable(identity) else None) or {}
            except Exception:  # identity() is informational; a failure must not block tokenizing
                special_map = {}
            for text, tid in special_map.items():
                if isinstance(text, str) and text and isinstance(tid, int):
                    specials[text] = tid
        for cand in set(_TEMPLATE_TOKEN_RE.findall(template)):
            if cand in specials:
                continue
            tid = tok.token_to_id(cand)
            # If plain encoding already yields this single id, it is an ordinary token and
            # must not be split out (it could then also be split out of user text).
            if tid is not None and tuple(tok.encode(cand)) != (tid,):
                specials[cand] = tid
        # Empty strings or strings that are pure whitespace would split everything.
        return {t: i for t, i in specials.items() if t.strip()}

    def _split(self, text: str) -> list[str]:
        return self._split_re.split(text) if self._split_re is not None else [text]

    # -- rendering ------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if self._use_tokenizer_apply is not False:
            apply = getattr(self.tokenizer, "apply_chat_template", None)
            if callable(apply):
                out = apply(messages, add_generation_prompt=add_generation_prompt)
                if isinstance(out, str):
                    self._use_tokenizer_apply = True
                    return out
            # No usable apply_chat_template (absent, or an HF one returning ids): render ourselves.
            self._use_tokenizer_apply = False
        if self._render_kwargs is None:
            tok = self.tokenizer
            kw: dict[str, str] = {}
            for key, tid in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id), ("pad_token", tok.pad_id)):
                if tid is not None:
                    kw[key] = tok.id_to_token(int(tid))
            self._render_kwargs = kw
        try:
            from prepack.text import transformers_quiet
            transformers_quiet.quiet()
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError as exc:  # pragma: no cover - transformers is in the pipeline extra
            raise ChatFormatError("template_error", f"rendering a chat template needs transformers (and jinja2): {exc}") from exc
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **self._render_kwargs,
        )
        return rendered[0]

    def _render_checked(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._render(messages, add_generation_prompt)
        except ChatFormatError:
            raise
        except Exception as exc:  # jinja's raise_exception(), TemplateError, ...
            raise ChatFormatError(
                "template_error", f"the chat template of {getattr(self.tokenizer, 'name', '?')!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def render(self, conv: Conversation) -> str:
        return self._render_checked(conv.messages, False)

    # -- layout ---------------------------------------------------------------------------

    def segments(self, conv: Conversation) -> list[Segment]:
        if self._split_re is not None:
            # The rendered string mixes markup and message text, so splitting it on special
            # tokens would also turn "<|im_end|>" typed inside a message into the real token
            # (transformers' own tokenize=True path does exactly that). Refuse instead, so
            # data can never inject control tokens; gemma/chatml encode such text as plain.
            for i, turn in enumerate(conv.turns):
                found = self._split_re.search(turn.content)
                if found is None and turn.reasoning is not None:
                    found = self._split_re.search(turn.reasoning)
                if found is not None:
                    raise ChatFormatError(
                        "special_token_in_text",
                        f"turn {i} ({turn.role}) contains the special token text {found.group(0)!r}; chat format 'hf' "
                        f"cannot keep it as plain text (use 'gemma' or 'chatml', which do)",
                    )
        messages = conv.messages
        n = len(messages)
        full = self._render_checked(messages, False)
        regions: list[tuple[int, int, int]] = []  # (start, end, loss) over `full`
        pos = 0
        for i in conv.loss_turns:
            prompt = self._render_checked(messages[:i], True)
            upto = full if i == n - 1 else self._render_checked(messages[: i + 1], False)
            if not (upto.startswith(prompt) and full.startswith(upto) and len(prompt) >= pos):
                raise ChatFormatError(
                    "template_not_prefix_stable",
                    f"the chat template of {getattr(self.tokenizer, 'name', '?')!r} does not render turn {i} as an extension "
                    f"of the shorter conversation, so the target cannot be located; use chat format 'gemma' or 'chatml'",
                )
            if len(upto) == len(prompt):
                raise ChatFormatError("empty_target", f"the chat template rendered nothing for target assistant turn {i}")
            regions.append((pos, len(prompt), 0))
            regions.append((len(prompt), len(upto), 1))
            pos = len(upto)
        regions.append((pos, len(full), 0))

        ids = self.special_ids
        segs: list[Segment] = []
        append = segs.append
        for start, end, loss in regions:
            if start == end:
                continue
            parts = self._split(full[start:end])
            last = len(parts) - 1
            for j, part in enumerate(parts):
                if j & 1:
                    append(((ids[part],), loss))
                elif part:
                    # Formatting whitespace after the target's closing special token is not
                    # something the model must predict (generation stops at that token).
                    trailing_ws = loss and j == last and last > 0 and not part.strip()
                    append((part, 0 if trailing_ws else loss))
        return segs


# --------------------------------------------------------------------------------------
# Registry and batch tokenization
# --------------------------------------------------------------------------------------

_FORMATS: dict[str, Callable[..., ChatFormat]] = {
    "gemma": GemmaFormat,
    "chatml": ChatMLFormat,
    "qwen3": Qwen3Format,
    "hf": HFTemplateFormat,
}


def chat_format_names() -> tuple[str, ...]:
    return (*_FORMATS, "auto")


def get_chat_format(name: str, tokenizer: "Tokenizer", train_reasoning: bool = True) -> ChatFormat:
    """Build chat format `name` for `tokenizer`.

    auto: 'hf' if the tokenizer has a chat template, else 'gemma' if it has
    <start_of_turn>, else 'qwen3' if it has <|im_start|>, <think> and </think>, else 'chatml'
    if it has <|im_start|>, else ChatFormatError.
    """
    if name == "auto":
        if getattr(tokenizer, "chat_template", None):
            return HFTemplateFormat(tokenizer)
        if tokenizer.token_to_id("<start_of_turn>") is not None:
            return GemmaFormat(tokenizer)
        if tokenizer.token_to_id("<|im_start|>") is not None:
            if all(tokenizer.token_to_id(t) is not None for t in ("<think>", "</think>")):
                return Qwen3Format(tokenizer, train_reasoning)
            return ChatMLFormat(tokenizer)
        raise ChatFormatError(
            "no_format_detected",
            f"chat format 'auto': tokenizer {getattr(tokenizer, 'name', '?')!r} has no chat template and neither "
            f"<start_of_turn> (gemma) nor <|im_start|> (chatml); choose a tokenizer with a chat template",
        )
    factory = _FORMATS.get(name)
    if factory is None:
        raise ChatFormatError("unknown_chat_format", f"unknown chat format {name!r}; expected one of {', '.join(chat_format_names())}")
    return Qwen3Format(tokenizer, train_reasoning) if factory is Qwen3Format else factory(tokenizer)


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
    convs: Sequence[Conversation], tokenizer: "Tokenizer", chat_format: "ChatFormat | str"
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
    convs: Sequence[Conversation], tokenizer: "Tokenizer", chat_format: "ChatFormat | str"
) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """tokenize_conversations without the per-example objects: (input_ids int32, loss_mask
    uint8, ends) for the whole batch, conversation k being [ends[k-1], ends[k]); None for an
    empty batch. Same ids, masks and errors as tokenize_conversations."""
    fmt = _resolve_format(chat_format, tokenizer)
    segments = fmt.segments
    all_segs: list[Segment] = []
    seg_counts: list[int] = []
    add_count = seg_counts.append
    for index, conv in enumerate(convs):
        try:
            segs = segments(conv)
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


# --------------------------------------------------------------------------------------
# Single-turn fast path
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairLayout:
    """What segments() gives for [user(prompt), assistant(response)] with loss on the reply:

        (before_prompt, 0) (prompt_prefix + prompt, 0) (between, 0) (response, 1)
        (after_response, 1) (closing, 0)

    prompt and response trimmed when `strip`; the response's leading `response_lstrip`
    characters removed (qwen3 drops newlines before the reply, as its template does). Only the two texts vary per example, so a
    batch of pairs is laid out with whole-array operations instead of per-segment Python.
    tests/test_templates.py checks it against segments() for every format that has one.
    """

    before_prompt: tuple[int, ...]
    prompt_prefix: str
    between: tuple[int, ...]
    after_response: tuple[int, ...]
    closing: tuple[int, ...]
    strip: bool
    response_lstrip: str = ""


def tokenize_pairs_flat(
    prompts: Sequence[str], responses: Sequence[str], tokenizer: "Tokenizer", chat_format: "ChatFormat | str"
) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """tokenize_conversations_flat for single-turn examples given as prompt and response
    texts: the same ids, masks and ends as for their Conversations, without building them.
    None for an empty batch. Raises ValueError for a format without a pair layout."""
    fmt = _resolve_format(chat_format, tokenizer)
    layout = fmt.pair_layout()
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
