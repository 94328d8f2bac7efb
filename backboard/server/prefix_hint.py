"""Where a chat prompt's leading system / developer messages (with the tools the template renders
beside them) end, in tokens. The engine keeps a prefix-cache state checkpoint there
(EngineCoreRequest.prefix_hint, core/prefix_cache.py), so the next conversation that shares the
system prompt resumes after it, even the first one to arrive after this request."""

from __future__ import annotations

from typing import Any

LEADING_ROLES = ("system", "developer")


def leading_messages(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    n = 0
    while n < len(conv) and conv[n].get("role") in LEADING_ROLES:
        n += 1
    return conv[:n]


def system_prefix_len(tokenizer, conv: list[dict[str, Any]], ids: list[int], **kw: Any) -> int:
    """Leading tokens of `ids` (the whole rendered prompt) that the leading system messages and
    tools render to on their own; 0 when there are none, nothing follows them, or they do not
    tokenize to a prefix of `ids` (a wrong hint would only cost a useless checkpoint: checkpoints
    are keyed by token ids)."""
    head = leading_messages(conv)
    if (not head and not kw.get("tools")) or len(head) == len(conv):
        return 0
    kw.pop("continue_final_message", None)
    try:
        head_ids = tokenizer.encode(tokenizer.apply_chat_template(head, False, **kw))
    except Exception:  # noqa: BLE001 - a template that needs a user turn: no hint
        return 0
    n = len(head_ids)
    return n if 0 < n < len(ids) and ids[:n] == head_ids else 0
