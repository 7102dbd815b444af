"""Chat format `hf`: the tokenizer's own jinja chat template (FunctionGemma, Gemma 4, Llama 3.x,
Mistral, ... write tool calls this way), with the loss mask found by rendering prefixes."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from prepack.text.chat.base import ChatFormat, ChatFormatError, Segment
from prepack.text.conversation import Conversation, json_text

if TYPE_CHECKING:
    from prepack.text.tokenizer import Tokenizer

__all__ = ["HFTemplateFormat"]

# Strings in a template that look like special tokens: <...>, <|...|>, [INST]-style.
_TEMPLATE_TOKEN_RE = re.compile(r"<\|?[^<>\s{}|]{1,64}\|?>|\[/?[A-Za-z_]{1,32}\]")


class HFTemplateFormat(ChatFormat):
    """Renders with the tokenizer's jinja `chat_template` and derives the loss mask by
    rendering prefixes: for each target assistant turn i, render(messages[:i],
    add_generation_prompt=True) is the prompt side and render(messages[:i+1]) ends after the
    reply; the text in between is the target. Every shorter rendering must be a prefix of
    the longer ones ("prefix stable"), else ChatFormatError(template_not_prefix_stable);
    templates that rewrite history (e.g. strip earlier reasoning) are not supported.

    Tools: the record's tools go to the template as `tools=` and its messages carry `tool_calls`
    (`{type: function, function: {name, arguments}}`, the arguments an object) and `tool` turns
    (with `name` / `tool_call_id` when the record gave them), the Hugging Face schema every tool
    template reads. A tool-calling turn's target is whatever the template writes for it, up to
    where the next message or the generation prompt starts.

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

    Rendering: `tokenizer.apply_chat_template(messages, add_generation_prompt=..., tools=...)` when the
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

    def _extra_specials(self) -> dict[int, str]:
        return {tid: text for text, tid in self.special_ids.items()}

    def _split(self, text: str) -> list[str]:
        return self._split_re.split(text) if self._split_re is not None else [text]

    # -- rendering ------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[Any] | None) -> str:
        if self._use_tokenizer_apply is not False:
            apply = getattr(self.tokenizer, "apply_chat_template", None)
            if callable(apply):
                out = apply(messages, add_generation_prompt=add_generation_prompt, tools=tools)
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
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **self._render_kwargs,
        )
        return rendered[0]

    def _render_checked(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                        tools: list[Any] | None = None) -> str:
        try:
            return self._render(messages, add_generation_prompt, tools)
        except ChatFormatError:
            raise
        except Exception as exc:  # jinja's raise_exception(), TemplateError, ...
            raise ChatFormatError(
                "template_error", f"the chat template of {getattr(self.tokenizer, 'name', '?')!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def render(self, conv: Conversation) -> str:  # type: ignore[override]
        return self._render_checked(conv.messages, False, list(conv.tools) or None)

    # -- layout ---------------------------------------------------------------------------

    def segments(self, conv: Conversation) -> list[Segment]:
        if self._split_re is not None:
            self._refuse_special_text(conv)
        messages = conv.messages
        tools = list(conv.tools) or None
        n = len(messages)
        full = self._render_checked(messages, False, tools)
        regions: list[tuple[int, int, int]] = []  # (start, end, loss) over `full`
        pos = 0
        for i in conv.loss_turns:
            prompt = self._render_checked(messages[:i], True, tools)
            upto = full if i == n - 1 else self._render_checked(messages[: i + 1], False, tools)
            if not (upto.startswith(prompt) and full.startswith(upto) and len(prompt) >= pos):
                raise ChatFormatError(
                    "template_not_prefix_stable",
                    f"the chat template of {getattr(self.tokenizer, 'name', '?')!r} does not render turn {i} as an extension "
                    f"of the shorter conversation (its rendering up to turn {i} is not a prefix of the whole), so the "
                    f"target cannot be located; use chat format 'gemma' or 'chatml', or a template that renders prefixes "
                    f"stably",
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

    def _refuse_special_text(self, conv: Conversation) -> None:
        """The rendered string mixes markup and message text, so splitting it on special tokens
        would also turn "<|im_end|>" typed inside a message (or a tool's schema, or a call's
        arguments) into the real token (transformers' own tokenize=True path does exactly that).
        Refuse instead, so data can never inject control tokens; gemma/chatml encode such text as
        plain."""
        assert self._split_re is not None
        search = self._split_re.search
        for i, turn in enumerate(conv.turns):
            texts = [turn.content, turn.reasoning or "", *(c.name + c.arguments_text for c in turn.tool_calls)]
            for text in texts:
                found = search(text)
                if found is not None:
                    raise ChatFormatError(
                        "special_token_in_text",
                        f"turn {i} ({turn.role}) contains the special token text {found.group(0)!r}; chat format 'hf' "
                        f"cannot keep it as plain text (use 'gemma' or 'chatml', which do)",
                    )
        for k, tool in enumerate(conv.tools):
            found = search(json_text(tool))
            if found is not None:
                raise ChatFormatError("special_token_in_text", f"tool {k} contains the special token text "
                                      f"{found.group(0)!r}; chat format 'hf' cannot keep it as plain text")
