"""/v1/responses (OpenAI's Responses API) on the chat machinery: text, reasoning and function calls,
whole and streamed.

A request becomes a ChatCompletionRequest (input items -> messages, `instructions` -> a system
message, Responses-style tools and tool_choice -> chat ones, `text.format` -> response_format,
`reasoning.effort` -> the template's enable_thinking) and runs through GenerationHandler: the same
template rendering, grammars (structured output, tool_choice required / named), reasoning and
tool-call parsers. Its output becomes output items in order: a `reasoning` item, a `message` item
(output_text), one `function_call` item per call. Streamed, the items open and close one after
another with the events the openai client folds into a Response (response.created ...
response.completed / response.incomplete; server/responses_stream.py).

Logprobs: `include: ["message.output_text.logprobs"]` (with `top_logprobs`, 0-20) asks for the
logprobs of the message's tokens, in each output_text part (and each output_text delta streamed).
When the output also has a reasoning block the message's are the trailing tokens that make its
text; next to function calls the message carries none.

Stored responses (server/response_store.py): unless `store` is false, a finished response is kept
with its conversation (input items and output items) in a bounded LRU; `previous_response_id`
continues that conversation (the new input appended to it; instructions are not carried over, as
in OpenAI's API), and GET / DELETE /v1/responses/{id} read and drop one."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from backboard.server import responses_items as I
from backboard.server.errors import APIError, bad_request
from backboard.server.protocol import ChatCompletionRequest, _Open
from backboard.server.response_store import ResponseStore
from backboard.server.responses_stream import ResponseEvents
from backboard.server.serving import GenerationHandler, SSEResponse

# chat-side parameter names -> the Responses request's fields (in 400s)
_PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
          "prompt": "input", "top_logprobs": "top_logprobs", "logprobs": "include"}
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(_Open):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    include: list[str] | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None     # vLLM's extension, as in chat
    metadata: dict[str, Any] | None = None


# ---- request -> chat request ------------------------------------------------------------------
def wants_logprobs(req: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (req.include or ())


def to_chat_request(req: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this Responses request means, its conversation being `items` (400s name
    the Responses field)."""
    body: dict[str, Any] = {"model": req.model, "messages": input_messages(items, req.instructions),
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
                            "chat_template_kwargs": _template_kwargs(req)}
    if req.tools:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if wants_logprobs(req):
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        body["response_format"] = _response_format(fmt)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise bad_request(f"input: {e.errors()[0].get('msg', e)}", "input") from e


def input_messages(items: str | list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Responses input items -> chat messages: messages, function calls (on the assistant turn that
    made them), function call outputs (tool messages) and reasoning (the next assistant turn's
    reasoning_content)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    reasoning = None
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            msgs.append(_message(item, i))
        elif kind == "function_call":
            _call_turn(msgs).setdefault("tool_calls", []).append(_call(item, i))
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                         "content": _item_text(item.get("output"), i)})
        elif kind == "reasoning":
            reasoning = "".join(p.get("text", "") for p in item.get("content") or item.get("summary") or ())
            continue
        else:
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported (message, "
                              "function_call, function_call_output, reasoning)", "input")
        if reasoning is not None and msgs[-1]["role"] == "assistant":
            msgs[-1]["reasoning_content"], reasoning = reasoning, None
    if not msgs:
        raise bad_request("input is empty", "input")
    return msgs


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"input[{i}].role must be user, assistant, system or developer; got {role!r}", "input")
    return {"role": "system" if role == "developer" else role, "content": _item_text(item.get("content"), i)}


def _item_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of parts", "input")
    bad = [p.get("type") for p in content if not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS]
    if bad:
        raise bad_request(f"input[{i}].content: parts of type {bad[0]!r} are not supported (text only)", "input")
    return "".join(p.get("text") or "" for p in content)


def _call_turn(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn a function call belongs to: the one just before it, or a new one."""
    if not msgs or msgs[-1]["role"] != "assistant":
        msgs.append({"role": "assistant", "content": ""})
    return msgs[-1]


def _call(item: dict[str, Any], i: int) -> dict[str, Any]:
    return {"id": _field(item, "call_id", i), "type": "function",
            "function": {"name": _field(item, "name", i), "arguments": item.get("arguments") or "{}"}}


def _field(item: dict[str, Any], name: str, i: int) -> str:
    v = item.get(name)
    if not isinstance(v, str) or not v:
        raise bad_request(f"input[{i}] ({item.get('type')}) needs {name}", "input")
    return v


def _chat_tool(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else t
        raise bad_request(f"tools[{i}]: tools of type {kind!r} are not supported (function only)", "tools")
    if isinstance(t.get("function"), dict):          # already the chat shape
        return t
    fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(tc: Any) -> Any:
    if isinstance(tc, dict) and tc.get("type") == "function" and "name" in tc:
        return {"type": "function", "function": {"name": tc["name"]}}
    return tc


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text")
    if fmt.get("type") != "json_schema":
        return fmt                                  # text, json_object (others: a 400 there)
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


def _template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    """reasoning.effort "none" turns thinking off, any other effort on (chat_template_kwargs win)."""
    kw = dict(req.chat_template_kwargs or {})
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and "enable_thinking" not in kw:
        kw["enable_thinking"] = effort != "none"
    return kw or None


# ---- the endpoints ------------------------------------------------------------------------------
class ResponsesAPI:
    """POST /v1/responses, and GET / DELETE /v1/responses/{id} on the store."""

    def __init__(self, gen: GenerationHandler, store: ResponseStore) -> None:
        self.gen, self.store = gen, store

    async def create(self, req: ResponsesRequest, raw: Request, arrival: float) -> Response:
        items = self.conversation(req)
        chat = to_chat_request(req, items)
        try:
            started = await self.gen.start_chat(chat, raw, arrival)
        except APIError as e:
            e.param = _PARAM.get(e.param, e.param)
            raise
        if started is None:
            return Response(status_code=499)            # the client is gone (nobody reads this)
        call, first = started
        head = _head(req, call.request_id, chat.model or self.gen.model_name)
        headers = {"x-request-id": call.request_id}
        on_done = (lambda final: self.store.put(final, items)) if req.store else None
        if req.stream:
            tt = self.gen.tt if wants_logprobs(req) else None
            events = ResponseEvents(head, tt, on_done).run(call, first)
            return SSEResponse(events, on_close=lambda: self.gen.engine.abort(call.request_id), headers=headers)
        body = await self.gen.collect(call, first, raw)
        if body is None:
            return Response(status_code=499)
        final = whole_response(head, body)
        if on_done is not None:
            on_done(final)
        return JSONResponse(final, headers=headers)

    def conversation(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        """The input items, after the stored conversation of previous_response_id."""
        items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) \
            else list(req.input)
        if req.previous_response_id is None:
            return items
        prev = self.store.get(req.previous_response_id)
        if prev is None:
            raise bad_request(f"Previous response with id '{req.previous_response_id}' not found (never "
                              "stored, or evicted from the server's bounded store)", "previous_response_id")
        return prev.items + items

    def get(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id")


def _head(req: ResponsesRequest, rid: str, model: str) -> dict[str, Any]:
    """The Response object without output, status and usage."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning,
            "metadata": req.metadata or {}, "previous_response_id": req.previous_response_id,
            "store": req.store, "top_logprobs": req.top_logprobs, "background": False,
            "truncation": "disabled", "error": None}


def whole_response(head: dict[str, Any], chat_body: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion -> the Response object."""
    choice, u = chat_body["choices"][0], chat_body["usage"]
    m, done = choice["message"], "incomplete" if choice["finish_reason"] == "length" else "completed"
    output = []
    if m.get("reasoning_content"):
        output.append(I.reasoning_item(I.new_id("rs_"), m["reasoning_content"], "completed"))
    if m.get("content"):
        lps = _message_logprobs(choice.get("logprobs"), m)
        output.append(I.message_item(I.new_id("msg_"), m["content"], done, lps))
    for c in m.get("tool_calls") or ():
        output.append(I.call_item(I.new_id("fc_"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                  "completed"))
    cached = u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return I.finished(head, output, choice["finish_reason"], u["prompt_tokens"], u["completion_tokens"], cached)


def _message_logprobs(logprobs: dict | None, m: dict[str, Any]) -> list[dict]:
    """The message's share of the choice's logprobs: all of them when the message is the whole
    output; after a reasoning block, the trailing tokens that make its text; none next to calls."""
    entries = (logprobs or {}).get("content") or []
    if not entries or m.get("tool_calls"):
        return []
    if not m.get("reasoning_content"):
        return entries
    need, n = len(m["content"]), 0
    while n < len(entries) and need > 0:
        n += 1
        need -= len(entries[-n]["token"])
    return entries[len(entries) - n:]
