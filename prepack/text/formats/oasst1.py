"""Format `oasst1`: the OpenAssistant/oasst1 message table, rebuilt into threads (table-level:
one record is one message, which only makes sense with its tree)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping

from prepack.text.conversation import Conversation, Turn
from prepack.text.formats.features import DroppedMessage, Oasst1Result, SourceFormat
from prepack.text.formats.fields import RequiredColumns
from prepack.text.formats.fields import describe as _describe

__all__ = ["OASST1_DROP_REASONS", "DroppedMessage", "Oasst1Result", "Oasst1Template", "oasst1_build",
           "oasst1_conversations"]

# Why a message of the oasst1 table produced no example and is not used as context.
OASST1_DROP_REASONS: tuple[str, ...] = (
    "invalid",          # not an object, or message_id/text/role missing or of the wrong type
    "duplicate_id",     # a second message with an already seen message_id
    "bad_role",         # role is neither "prompter" nor "assistant"
    "empty_text",       # text is empty/whitespace
    "deleted",          # deleted is True
    "not_english",      # lang != "en"
    "review_failed",    # review_result is not True (False or missing)
    "assistant_root",   # a thread starts with an assistant message: no prompt to answer
    "missing_parent",   # parent_id names a message that is not in the table given
    "orphaned",         # some ancestor was dropped, so the thread prefix is incomplete
    "cycle",            # the parent_id links loop
)


_OASST1_ROLES: dict[str, str] = {"prompter": "user", "assistant": "assistant"}


def _oasst1_own_problem(msg: Mapping[str, Any]) -> tuple[str, str] | None:
    """Checks that depend on the message alone: (reason, detail) or None if it is usable."""
    role = msg.get("role")
    if role not in _OASST1_ROLES:
        return "bad_role", f"role: expected 'prompter' or 'assistant', got {_describe(role)}"
    text = msg.get("text")
    if not isinstance(text, str):
        return "invalid", f"text: expected a string, got {_describe(text)}"
    if not text.strip():
        return "empty_text", "text is empty or whitespace"
    # A missing `deleted` counts as not deleted (some exports omit it); a missing
    # review_result is not a pass, because the review is the quality gate we filter on.
    if msg.get("deleted") is True:
        return "deleted", "deleted is true"
    if msg.get("lang") != "en":
        return "not_english", f"lang: expected 'en', got {_describe(msg.get('lang'))}"
    if msg.get("review_result") is not True:
        return "review_failed", f"review_result: expected true, got {_describe(msg.get('review_result'))}"
    return None


def oasst1_build(messages: Iterable[Mapping[str, Any]]) -> Oasst1Result:
    """Rebuild oasst1 threads from a table of messages (normally one message_tree_id).

    Keeps messages with lang == "en", review_result True and deleted not True; a message
    below a dropped one is dropped as "orphaned". Every kept assistant message becomes one
    example: the turns from the thread root down to it (prompter -> user), loss only on
    that last turn, example_id = its message_id. Prompter messages never become examples
    themselves and are not listed as dropped when they simply have no reply.

    Output order is sorted by (message_tree_id, message_id), independent of input order.
    """
    dropped: list[DroppedMessage] = []
    by_id, own_drop = _oasst1_index(messages, dropped)
    resolved = _oasst1_resolve(by_id, own_drop)
    examples_keyed: list[tuple[tuple[str, str], Conversation, str]] = []
    for mid, msg in by_id.items():
        value = resolved[mid]
        tree = msg.get("message_tree_id")
        tree_key = tree if isinstance(tree, str) else ""
        if _is_drop(value):
            reason, detail = value  # type: ignore[misc]
            dropped.append(DroppedMessage(mid, tree if isinstance(tree, str) else None, reason, detail))
        elif msg["role"] == "assistant":
            turns = value  # type: ignore[assignment]
            conv = Conversation(turns, (len(turns) - 1,))  # type: ignore[arg-type]
            examples_keyed.append(((tree_key, mid), conv, mid))

    examples_keyed.sort(key=lambda item: item[0])
    dropped.sort(key=lambda d: (d.message_tree_id or "", d.message_id or "", d.reason))
    return Oasst1Result([(conv, eid) for _, conv, eid in examples_keyed], dropped)


def _oasst1_index(messages: Iterable[Mapping[str, Any]], dropped: list[DroppedMessage]
                  ) -> tuple[dict[str, Mapping[str, Any]], dict[str, tuple[str, str]]]:
    """The messages by id, and each one's own drop reason (its fields, not its ancestors');
    messages without a usable id go straight to `dropped`."""
    by_id: dict[str, Mapping[str, Any]] = {}
    own_drop: dict[str, tuple[str, str]] = {}
    for msg in messages:
        if not isinstance(msg, Mapping):
            dropped.append(DroppedMessage(None, None, "invalid", f"expected a message object, got {_describe(msg)}"))
            continue
        mid = msg.get("message_id")
        tree = msg.get("message_tree_id")
        tree = tree if isinstance(tree, str) else None
        if not isinstance(mid, str) or not mid:
            dropped.append(DroppedMessage(None, tree, "invalid", f"message_id: expected a non-empty string, got {_describe(mid)}"))
            continue
        if mid in by_id:
            dropped.append(DroppedMessage(mid, tree, "duplicate_id", "a message with this message_id came earlier; the first is kept"))
            continue
        parent = msg.get("parent_id")
        if parent is not None and not isinstance(parent, str):
            own_drop[mid] = ("invalid", f"parent_id: expected a string or null, got {_describe(parent)}")
        else:
            problem = _oasst1_own_problem(msg)
            if problem is not None:
                own_drop[mid] = problem
        by_id[mid] = msg
    return by_id, own_drop


def _is_drop(value: tuple[Any, ...]) -> bool:
    return bool(value) and isinstance(value[0], str)


def _oasst1_resolve(by_id: dict[str, Mapping[str, Any]], own_drop: dict[str, tuple[str, str]]
                    ) -> dict[str, tuple[Turn, ...] | tuple[str, str]]:
    """Every message's turn prefix (root..message) or drop reason. An iterative walk up the parent
    chain with memoisation: deep threads cannot hit the recursion limit, and each message is
    resolved once."""
    resolved: dict[str, tuple[Turn, ...] | tuple[str, str]] = {}  # id -> turns | (reason, detail)
    for start in by_id:
        chain: list[str] = []
        on_chain: set[str] = set()
        cur: str | None = start
        while cur is not None and cur not in resolved and cur in by_id and cur not in on_chain:
            chain.append(cur)
            on_chain.add(cur)
            cur = by_id[cur].get("parent_id")
        if cur is not None and cur in on_chain:
            # Never seen in real data; every message on the walked chain is unusable.
            for mid in chain:
                resolved[mid] = ("cycle", f"parent_id links loop through message {cur}")
            continue
        # What sits above the top of the chain: nothing (root), an already resolved
        # ancestor, or a parent_id that names no message in the table.
        missing_parent = cur is not None and cur not in resolved
        acc: tuple[Turn, ...] | tuple[str, str] = () if cur is None or missing_parent else resolved[cur]
        for depth, mid in enumerate(reversed(chain)):
            own = own_drop.get(mid)
            if own is not None:
                acc = own
            elif depth == 0 and missing_parent:
                acc = ("missing_parent", f"parent message {cur} is not in the table")
            elif _is_drop(acc):
                parent_id = by_id[mid].get("parent_id")
                acc = ("orphaned", f"parent message {parent_id} was dropped ({acc[0]})")
            else:
                msg = by_id[mid]
                role = _OASST1_ROLES[msg["role"]]
                if not acc and role == "assistant":
                    acc = ("assistant_root", "the thread starts with an assistant message, so there is no prompt")
                else:
                    acc = acc + (Turn(role, msg["text"]),)  # type: ignore[operator]
            resolved[mid] = acc
    return resolved


def oasst1_conversations(
    messages: Iterable[Mapping[str, Any]], dropped: list[DroppedMessage] | None = None
) -> list[tuple[Conversation, str]]:
    """`oasst1_build(messages).examples`; dropped messages are appended to `dropped` when
    a list is given (so callers that only want examples keep a plain list return)."""
    result = oasst1_build(messages)
    if dropped is not None:
        dropped.extend(result.dropped)
    return result.examples


@dataclass(frozen=True)
class Oasst1Template(SourceFormat, RequiredColumns):
    """Registry entry for the OpenAssistant/oasst1 message table.

    table_level is True: a single record is one message and cannot be converted alone.
    The pipeline groups records by `group_key` and calls `conversations_from_table`.
    """

    name: ClassVar[str] = "oasst1"
    table_level: ClassVar[bool] = True
    group_key: ClassVar[str | None] = "message_tree_id"
    _required: ClassVar[tuple[str, ...]] = ("message_id", "message_tree_id", "role", "text")

    def conversations_from_table(self, messages: Iterable[Mapping[str, Any]]) -> Oasst1Result:
        return oasst1_build(messages)

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        raise NotImplementedError(
            "oasst1 is a table-level format: group its messages by 'message_tree_id' and call "
            "conversations_from_table(messages) (or oasst1_conversations)"
        )
