"""A streamed /v1/responses: the event sequence the openai client folds into a Response
(response.created ... response.completed / response.incomplete). Output items open as their first
text arrives and close when another one opens (or at the end); with logprobs asked for, each
output_text delta carries the logprobs of the tokens that made it."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

from backboard.core.outputs import TokenLogprobs
from backboard.engine.request_stream import EngineDeadError, RequestDelta
from backboard.server import responses as R
from backboard.server import responses_items as I
from backboard.server.chat_output import DeltaMessage, finish_reason

_PREFIX = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}


class _Item:
    """An output item being streamed: its kind, id, index in `output`, text and logprobs so far."""

    def __init__(self, kind: str, index: int, call_id: str | None = None, name: str | None = None) -> None:
        self.kind, self.index = kind, index
        self.id = I.new_id(_PREFIX[kind])
        self.call_id, self.name, self.text = call_id, name, ""
        self.logprobs: list[dict] = []

    def final(self, status: str = "completed") -> dict[str, Any]:
        if self.kind == "reasoning":
            return I.reasoning_item(self.id, self.text, status)
        if self.kind == "message":
            return I.message_item(self.id, self.text, status, self.logprobs)
        return I.call_item(self.id, self.call_id or "", self.name or "", self.text, status)


class ResponseEvents:
    """The event stream of one response. Whitespace between reasoning and calls opens no message.
    `tt` (token text) is given when logprobs were asked for; `on_done` gets the final Response."""

    def __init__(self, head: dict[str, Any], tt: R.TokenText | None = None,
                 on_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.head, self.seq, self.tt, self.on_done = head, 0, tt, on_done
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}         # tool-call index -> its item
        self.held = ""                            # content that is only whitespace so far
        self.pending: list[TokenLogprobs] = []    # logprobs of tokens whose text has not gone out

    async def run(self, call, first: list[RequestDelta]) -> AsyncIterator[bytes]:
        in_progress = {**self.head, "status": "in_progress", "output": []}
        out = [self.event("response.created", response=in_progress),
               self.event("response.in_progress", response=in_progress)]
        parser = call.parsers[0] if call.parsers else None
        finish, num_output, deltas = None, 0, first
        try:
            while deltas:
                for d in (c for rd in deltas for c in rd.outputs):
                    dm = parser.feed(d.text) if parser is not None else DeltaMessage(content=d.text)
                    if d.finish_reason is not None and parser is not None:
                        dm = dm.add(parser.finish())
                    num_output += len(d.token_ids)
                    out += self.feed(dm, d.logprobs)
                    finish = finish_reason(d.finish_reason, bool(self.calls)) or finish
                if out:
                    yield b"".join(out)
                    out = []
                deltas = await call.stream.get()
        except EngineDeadError as e:
            yield self.event("error", code="server_error", message=str(e), param=None)
            return
        stream = call.stream
        yield b"".join(self.end(finish, stream.num_prompt_tokens, num_output, stream.num_cached_tokens))

    def event(self, type_: str, **fields: Any) -> bytes:
        self.seq += 1
        return b"event: " + type_.encode() + b"\n" + R.sse({"type": type_, "sequence_number": self.seq - 1,
                                                            **fields})

    def feed(self, dm: DeltaMessage, logprobs: list[TokenLogprobs] | None = None) -> list[bytes]:
        self.pending.extend(logprobs or ())
        out = self._text("reasoning", dm.reasoning) if dm.reasoning else []
        if dm.content:
            text = self.held + dm.content
            if not text.strip() and not (self.open is not None and self.open.kind == "message"):
                self.held = text                  # whitespace before any answer text: held back
            else:
                self.held = ""
                out += self._text("message", text)
        out += self._calls(dm)
        if out:
            self.pending = []                     # the tokens went out with reasoning or calls
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        out = [] if self.open is not None and self.open.kind == kind else self._start(kind)
        it = self.open
        it.text += text
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", item_id=it.id, output_index=it.index,
                                     content_index=0, delta=text)]
        lps = I.text_logprobs(self.pending, self.tt) if self.tt is not None else []
        it.logprobs += lps
        self.pending = []
        return out + [self.event("response.output_text.delta", item_id=it.id, output_index=it.index,
                                 content_index=0, delta=text, logprobs=lps)]

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
        added = it.final("in_progress")
        if kind != "function_call":
            added["content"] = []
        out.append(self.event("response.output_item.added", output_index=it.index, item=added))
        if kind != "function_call":
            part = I.output_text("") if kind == "message" else {"type": "reasoning_text", "text": ""}
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
            extra = {} if it.kind == "reasoning" else {"logprobs": it.logprobs}
            out = [self.event(name, content_index=0, text=it.text, **ids, **extra),
                   self.event("response.content_part.done", content_index=0, part=part, **ids)]
        return out + [self.event("response.output_item.done", output_index=it.index, item=it.final(status))]

    def end(self, finish: str | None, num_prompt: int, num_output: int, num_cached: int = 0) -> list[bytes]:
        out = []
        if self.held and not self.calls:              # an answer of whitespace only
            out += self._text("message", self.held)
        status = "incomplete" if finish == "length" else "completed"
        out += self._close(status if self.open is not None and self.open.kind == "message" else "completed")
        final = I.finished(self.head, [it.final(status if it.kind == "message" else "completed")
                                       for it in self.items], finish, num_prompt, num_output, num_cached)
        if self.on_done is not None:
            self.on_done(final)
        return out + [self.event("response." + final["status"], response=final)]
