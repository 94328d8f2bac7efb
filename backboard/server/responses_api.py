"""/v1/responses (OpenAI's Responses API) on the chat machinery: text, reasoning and function calls,
whole and streamed.

A request becomes a ChatCompletionRequest (input items -> messages, `instructions` -> a system
message, Responses-style tools and tool_choice -> chat ones, `text.format` -> response_format,
`reasoning.effort` -> the template's enable_thinking) and runs through GenerationHandler: the same
template rendering, grammars (structured output, tool_choice required / named), reasoning and
tool-call parsers. Its output becomes output items in order: a `reasoning` item, a `message` item
(output_text), one `function_call` item per call. Streamed, the items open and close one after
another with the events the openai client folds into a Response (response.created ...
response.completed / response.incomplete). Nothing is stored: `previous_response_id` is a 400."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from backboard.engine.request_stream import EngineDeadError, RequestDelta
from backboard.server import responses as R
from backboard.server.chat_output import DeltaMessage, finish_reason
from backboard.server.errors import APIError, bad_request
from backboard.server.protocol import ChatCompletionRequest, _Open
from backboard.server.serving import GenerationHandler, SSEResponse

# chat-side parameter names -> the Responses request's fields (in 400s)
_PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
          "prompt": "input"}
_TEXT_PARTS = ("input_text", "output_text", "text")


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
    chat_template_kwargs: dict[str, Any] | None = None     # vLLM's extension, as in chat
    metadata: dict[str, Any] | None = None


# ---- request -> chat request ------------------------------------------------------------------
def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request means (400s name the Responses field)."""
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported (responses are not stored): send the "
                          "conversation in input", "previous_response_id")
    body: dict[str, Any] = {"model": req.model, "messages": input_messages(req.input, req.instructions),
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
                            "chat_template_kwargs": _template_kwargs(req)}
    if req.tools:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
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


# ---- the endpoint -------------------------------------------------------------------------------
async def create_response(gen: GenerationHandler, req: ResponsesRequest, raw: Request, arrival: float) -> Response:
    chat = to_chat_request(req)
    try:
        started = await gen.start_chat(chat, raw, arrival)
    except APIError as e:
        e.param = _PARAM.get(e.param, e.param)
        raise
    if started is None:
        return Response(status_code=499)            # the client is gone (nobody reads this)
    call, first = started
    head = _head(req, call.request_id, chat.model or gen.model_name)
    headers = {"x-request-id": call.request_id}
    if req.stream:
        events = ResponseEvents(head).run(call, first, gen)
        return SSEResponse(events, on_close=lambda: gen.engine.abort(call.request_id), headers=headers)
    body = await gen.collect(call, first, raw)
    if body is None:
        return Response(status_code=499)
    return JSONResponse(whole_response(head, body), headers=headers)


def _head(req: ResponsesRequest, rid: str, model: str) -> dict[str, Any]:
    """The Response object without output, status and usage."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning,
            "metadata": req.metadata or {}, "previous_response_id": None, "store": False,
            "background": False, "truncation": "disabled", "error": None}


def _finish(head: dict[str, Any], output: list[dict], finish: str | None, num_prompt: int,
            num_output: int) -> dict[str, Any]:
    incomplete = finish == "length"
    return {**head, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "output": output,
            "usage": {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": num_prompt + num_output}}


def whole_response(head: dict[str, Any], chat_body: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion -> the Response object."""
    choice, u = chat_body["choices"][0], chat_body["usage"]
    m, done = choice["message"], "incomplete" if choice["finish_reason"] == "length" else "completed"
    output = []
    if m.get("reasoning_content"):
        output.append(reasoning_item(_new_id("rs_"), m["reasoning_content"], "completed"))
    if m.get("content"):
        output.append(message_item(_new_id("msg_"), m["content"], done))
    for c in m.get("tool_calls") or ():
        output.append(call_item(_new_id("fc_"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                "completed"))
    return _finish(head, output, choice["finish_reason"], u["prompt_tokens"], u["completion_tokens"])


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# ---- streaming ----------------------------------------------------------------------------------
class _Item:
    """An output item being streamed: its kind, id, index in `output`, and text so far."""

    def __init__(self, kind: str, index: int, call_id: str | None = None, name: str | None = None) -> None:
        self.kind, self.index = kind, index
        self.id = _new_id({"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}[kind])
        self.call_id, self.name, self.text = call_id, name, ""

    def final(self, status: str = "completed") -> dict[str, Any]:
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text, status)
        if self.kind == "message":
            return message_item(self.id, self.text, status)
        return call_item(self.id, self.call_id or "", self.name or "", self.text, status)


class ResponseEvents:
    """The event stream of one response: items open as their first text arrives and close when
    another one opens (or at the end). Whitespace between reasoning and calls opens no message."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.head, self.seq = head, 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}         # tool-call index -> its item
        self.held = ""                            # content that is only whitespace so far

    async def run(self, call, first: list[RequestDelta], gen: GenerationHandler) -> AsyncIterator[bytes]:
        out: list[bytes] = [self.event("response.created", response={**self.head, "status": "in_progress",
                                                                     "output": []}),
                            self.event("response.in_progress", response={**self.head, "status": "in_progress",
                                                                         "output": []})]
        parser = call.parsers[0] if call.parsers else None
        finish, num_output, deltas = None, 0, first
        try:
            while deltas:
                for d in (c for rd in deltas for c in rd.outputs):
                    dm = parser.feed(d.text) if parser is not None else DeltaMessage(content=d.text)
                    if d.finish_reason is not None and parser is not None:
                        dm = dm.add(parser.finish())
                    num_output += len(d.token_ids)
                    out += self.feed(dm)
                    finish = finish_reason(d.finish_reason, bool(self.calls)) or finish
                if out:
                    yield b"".join(out)
                    out = []
                deltas = await call.stream.get()
        except EngineDeadError as e:
            yield self.event("error", code="server_error", message=str(e), param=None)
            return
        yield b"".join(self.end(finish, call.stream.num_prompt_tokens, num_output))

    def event(self, type_: str, **fields: Any) -> bytes:
        self.seq += 1
        return b"event: " + type_.encode() + b"\n" + R.sse({"type": type_, "sequence_number": self.seq - 1,
                                                            **fields})

    def feed(self, dm: DeltaMessage) -> list[bytes]:
        out = self._text("reasoning", dm.reasoning) if dm.reasoning else []
        if dm.content:
            text = self.held + dm.content
            if not text.strip() and not (self.open is not None and self.open.kind == "message"):
                self.held = text                  # whitespace before any answer text: held back
            else:
                self.held = ""
                out += self._text("message", text)
        return out + self._calls(dm)

    def _text(self, kind: str, text: str) -> list[bytes]:
        out = [] if self.open is not None and self.open.kind == kind else self._start(kind)
        it = self.open
        it.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self.event(name, item_id=it.id, output_index=it.index, content_index=0, delta=text, **extra)]

    def _calls(self, dm: DeltaMessage) -> list[bytes]:
        out = []
        for t in dm.tool_calls:
            it = self.calls.get(t.index)
            if it is None:
                out += self._start("function_call", t.id, t.name)
                it = self.calls[t.index] = self.open
            if t.arguments:
                it.text += t.arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=it.id,
                                      output_index=it.index, delta=t.arguments))
        return out

    def _start(self, kind: str, call_id: str | None = None, name: str | None = None) -> list[bytes]:
        out = self._close()
        it = self.open = _Item(kind, len(self.items), call_id, name)
        self.items.append(it)
        out.append(self.event("response.output_item.added", output_index=it.index,
                              item=it.final("in_progress") if kind == "function_call" else
                              (reasoning_item if kind == "reasoning" else message_item)(it.id, None, "in_progress")))
        if kind != "function_call":
            part = output_text("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.content_part.added", item_id=it.id, output_index=it.index,
                                  content_index=0, part=part))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        it, self.open = self.open, None
        if it is None:
            return []
        ids = {"item_id": it.id, "output_index": it.index}
        if it.kind == "function_call":
            out = [self.event("response.function_call_arguments.done", arguments=it.text, **ids)]
        else:
            part = it.final(status)["content"][0]
            name = "response.reasoning_text.done" if it.kind == "reasoning" else "response.output_text.done"
            extra = {} if it.kind == "reasoning" else {"logprobs": []}
            out = [self.event(name, content_index=0, text=it.text, **ids, **extra),
                   self.event("response.content_part.done", content_index=0, part=part, **ids)]
        return out + [self.event("response.output_item.done", output_index=it.index, item=it.final(status))]

    def end(self, finish: str | None, num_prompt: int, num_output: int) -> list[bytes]:
        out = []
        if self.held and not self.calls:              # an answer of whitespace only
            out += self._text("message", self.held)
        status = "incomplete" if finish == "length" else "completed"
        out += self._close(status if self.open is not None and self.open.kind == "message" else "completed")
        final = _finish(self.head, [it.final(status if it.kind == "message" else "completed") for it in self.items],
                        finish, num_prompt, num_output)
        return out + [self.event("response." + final["status"], response=final)]
