"""The Responses API's objects as plain dicts: output items (reasoning, message, function_call),
output_text parts with their logprobs, and the finished Response."""

from __future__ import annotations

import uuid
from typing import Any

from backboard.core.outputs import TokenLogprobs
from backboard.server import responses as R


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def text_logprobs(lps: list[TokenLogprobs], tt: R.TokenText) -> list[dict]:
    """Responses' logprobs of output_text: [{token, logprob, bytes, top_logprobs: [...]}] (chat's)."""
    return R.chat_logprobs(lps, tt)["content"]


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def finished(head: dict[str, Any], output: list[dict], finish: str | None, num_prompt: int,
             num_output: int, num_cached: int = 0) -> dict[str, Any]:
    """The Response object: status `incomplete` only when max_output_tokens cut it."""
    incomplete = finish == "length"
    return {**head, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "output": output,
            "usage": {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": num_cached},
                      "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": num_prompt + num_output}}
