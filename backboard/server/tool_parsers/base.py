"""Tool calls in the model's text -> OpenAI `tool_calls`, streaming (incremental deltas) and not.

A ToolCallStream reads one channel's text (the content, or the reasoning: calls made inside the
reasoning block are returned too) in pieces: text outside `<tool_call> ... </tool_call>` passes
through as content; each call's text goes to a per-call state of the format (ToolCall subclasses:
hermes JSON, Qwen XML) that emits its name as soon as it is known and its arguments as they form.
The arguments of one call, concatenated over its deltas, are a JSON object's text. A call that turns
out malformed before anything of it was sent comes out as plain content instead."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from backboard.server.text_markers import split_safe


@dataclass
class ToolCallDelta:
    """One piece of one call: the first carries id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
            fn = {"name": self.name, "arguments": self.arguments}
        d["function"] = fn
        return d


@dataclass
class ToolCall:
    """A whole call (the deltas of one index merged)."""

    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.id or new_call_id(), d.name or "")
        calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class CallIndex:
    """The next tool-call index of one choice, shared by its channels."""

    next: int = 0
    max_calls: int | None = None       # 1 when parallel_tool_calls is false

    def take(self) -> int | None:
        if self.max_calls is not None and self.next >= self.max_calls:
            return None
        self.next += 1
        return self.next - 1


class CallState:
    """One call of a format, fed its growing body (the text after `<tool_call>`)."""

    def __init__(self, index: int, schemas: dict[str, dict]) -> None:
        self.index, self.schemas = index, schemas
        self.id = new_call_id()
        self.sent_name = False
        self.failed = False

    def update(self, body: str, complete: bool) -> list[ToolCallDelta]:
        """Deltas for what `body` adds; `complete`: the closing tag arrived. Sets `failed` when a
        complete body is not a call."""
        raise NotImplementedError

    def end_at(self, body: str, text: str, end: str) -> int:
        """Where the closing tag starts in `text`, which follows `body`; -1 when not yet there."""
        return text.find(end)

    def _name(self, name: str) -> ToolCallDelta:
        self.sent_name = True
        return ToolCallDelta(self.index, self.id, name, "")


@dataclass
class StreamOut:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream:
    def __init__(self, parser: "ToolParser", counter: CallIndex) -> None:
        self.parser, self.counter = parser, counter
        self.buf = ""
        self.call: CallState | None = None
        self.dropped = False              # inside a call past max_calls: its text goes nowhere
        self.body = ""

    def feed(self, text: str) -> StreamOut:
        self.buf += text
        out = StreamOut()
        while self._step(out):
            pass
        return out

    def finish(self) -> StreamOut:
        """End of output: a call never closed ends as it stands; held-back text is content."""
        out = StreamOut()
        if self.call is not None or self.dropped:
            self.body += self.buf
            self._end_call(out, complete=False)
        else:
            out.content += self.buf
        self.buf = ""
        return out

    def _step(self, out: StreamOut) -> bool:
        p = self.parser
        if self.call is None and not self.dropped:
            i = self.buf.find(p.start)
            if i < 0:
                safe, self.buf = split_safe(self.buf, (p.start,))
                out.content += safe
                return False
            out.content += self.buf[:i]
            self.buf = self.buf[i + len(p.start):]
            index = self.counter.take()
            self.call = p.new_call(index, p.schemas) if index is not None else None
            self.dropped, self.body = index is None, ""
            return True
        j = self.call.end_at(self.body, self.buf, p.end) if self.call is not None else self.buf.find(p.end)
        if j < 0:
            safe, self.buf = split_safe(self.buf, (p.end,))
            self.body += safe
            if self.call is not None and safe:
                out.calls += self.call.update(self.body, complete=False)
            return False
        self.body += self.buf[:j]
        self.buf = self.buf[j + len(p.end):]
        self._end_call(out, complete=True)
        return True

    def _end_call(self, out: StreamOut, complete: bool) -> None:
        call, self.call, self.dropped = self.call, None, False
        if call is None:
            return
        deltas = call.update(self.body, complete=True)
        if call.failed and not call.sent_name:
            if self.counter.next == call.index + 1:       # its index goes to the next call
                self.counter.next -= 1
            out.content += self.parser.start + self.body + (self.parser.end if complete else "")
            return
        out.calls += deltas


class ToolParser:
    """A tool-call format (`--tool-call-parser NAME`): its tags, per-call parsing, and the xgrammar
    structural-tag model that constrains `tool_choice` required / named calls to it."""

    name = ""
    start = "<tool_call>"
    end = "</tool_call>"
    structural_tag_model = ""
    call_class: type[CallState] = CallState

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                        for t in tools or () if t.get("type", "function") == "function"}

    def new_call(self, index: int, schemas: dict[str, dict]) -> CallState:
        return self.call_class(index, schemas)

    def stream(self, counter: CallIndex | None = None) -> ToolCallStream:
        return ToolCallStream(self, counter or CallIndex())

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output: (content, calls)."""
        s = self.stream()
        a, b = s.feed(text), s.finish()
        return a.content + b.content, merge_deltas(a.calls + b.calls)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
