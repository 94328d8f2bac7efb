"""Stored responses of /v1/responses (`store`, `previous_response_id`, GET /v1/responses/{id}).

A bounded, in-memory LRU: at most `max_entries` responses and `max_chars` characters of stored
conversation (the response's input items and its output items, flattened), the least recently
used going first. Nothing survives a restart; a response evicted or never stored is unknown (a
follow-up naming it is a 400 on previous_response_id, a GET a 404)."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]           # the Response object as it was returned
    items: list[dict[str, Any]]        # the conversation it ended: its input items, then its output
    size: int                          # characters held (of items and response, as JSON)


class ResponseStore:
    def __init__(self, max_entries: int, max_chars: int) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Store a finished response with the input items it answered (the whole conversation)."""
        items = input_items + [_as_input(o) for o in response.get("output", ())]
        size = len(json.dumps(items)) + len(json.dumps(response))
        if size > self.max_chars:
            return                                      # larger than the whole store: not kept
        self.delete(response["id"])
        self._entries[response["id"]] = StoredResponse(response, items, size)
        self.num_chars += size
        while len(self._entries) > self.max_entries or self.num_chars > self.max_chars:
            self._evict_oldest()

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_chars -= entry.size
        return entry is not None

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_chars -= entry.size


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item that replays it (logprobs dropped)."""
    if item.get("type") != "message":
        return item
    parts = [{"type": "output_text", "text": p.get("text", "")} for p in item.get("content", ())]
    return {"type": "message", "role": item.get("role", "assistant"), "content": parts}
