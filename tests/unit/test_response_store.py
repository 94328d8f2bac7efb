"""The /v1/responses store: an LRU bounded in entries and characters; a stored response replays
as its input items followed by its output items."""

from __future__ import annotations

from backboard.server.response_store import ResponseStore


def response(rid: str, text: str = "hi") -> dict:
    return {"id": rid, "object": "response", "output": [
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": [{"token": "h"}]}]}]}


def test_conversation_is_input_then_output():
    s = ResponseStore(4, 1 << 20)
    s.put(response("a", "Paris."), [{"type": "message", "role": "user", "content": "Capital?"}])
    entry = s.get("a")
    assert entry.response["id"] == "a"
    assert entry.items == [{"type": "message", "role": "user", "content": "Capital?"},
                           {"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": "Paris."}]}]


def test_least_recently_used_goes_first_by_count():
    s = ResponseStore(2, 1 << 20)
    s.put(response("a"), [])
    s.put(response("b"), [])
    assert s.get("a") is not None                     # a is now the most recent
    s.put(response("c"), [])
    assert [r for r in "abc" if s.get(r) is not None] == ["a", "c"] and len(s) == 2


def test_bounded_by_characters():
    one = ResponseStore(100, 1 << 20)
    one.put(response("a", "x" * 1000), [])
    size = one.num_chars
    s = ResponseStore(100, 2 * size + 10)
    for rid in "abcd":
        s.put(response(rid, "x" * 1000), [])
    assert len(s) == 2 and s.num_chars <= 2 * size + 10 and s.get("d") is not None
    s.put(response("huge", "x" * 10 * size), [])     # larger than the whole store: not kept
    assert s.get("huge") is None and len(s) == 2
    assert s.delete("d") and not s.delete("d") and s.num_chars == size
