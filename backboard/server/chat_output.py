"""One chat choice's text -> what the response carries: reasoning_content, content and tool_calls.

The reasoning parser splits the text first; a tool-call parser then reads each channel (calls made
inside the reasoning block are returned too, with indices shared across both). The same code runs
for streamed chunks (feed / finish: deltas) and whole responses (whole)."""

from __future__ import annotations

from dataclasses import dataclass, field

from backboard.server.reasoning import ReasoningDelta, ReasoningParser
from backboard.server.tool_parsers import CallIndex, ToolCall, ToolCallDelta, ToolParser, merge_deltas
from backboard.server.tool_parsers.base import StreamOut, ToolCallStream


@dataclass
class DeltaMessage:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: "DeltaMessage") -> "DeltaMessage":
        return DeltaMessage(self.reasoning + other.reasoning, self.content + other.content,
                            self.tool_calls + other.tool_calls)


@dataclass
class ChatMessageParts:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChoiceParser:
    """`content_calls` False: the content is a structured-output grammar's (a JSON answer), never
    read for calls, so a call marker inside one of its strings cannot cut it; calls made inside
    the reasoning block are still returned."""

    def __init__(self, reasoning: ReasoningParser | None, reasoning_state: str,
                 tools: ToolParser | None, parallel_tool_calls: bool = True, content_calls: bool = True) -> None:
        self.reasoning = reasoning.stream(reasoning_state) if reasoning is not None else None
        counter = CallIndex(max_calls=None if parallel_tool_calls else 1)
        self.in_content = tools.stream(counter) if tools is not None and content_calls else None
        self.in_reasoning = tools.stream(counter) if tools is not None else None
        self.num_calls = 0

    def feed(self, text: str) -> DeltaMessage:
        rd = self.reasoning.feed(text) if self.reasoning is not None else ReasoningDelta(content=text)
        return self._calls(rd)

    def finish(self) -> DeltaMessage:
        rd = self.reasoning.finish() if self.reasoning is not None else ReasoningDelta()
        out = self._calls(rd)
        if self.in_reasoning is not None:
            a, b = self.in_reasoning.finish(), _finish(self.in_content)
            out = out.add(DeltaMessage(a.content, b.content, a.calls + b.calls))
        self.num_calls += len({d.index for d in out.tool_calls if d.id is not None})
        return out

    def whole(self, text: str) -> ChatMessageParts:
        d = self.feed(text).add(self.finish())
        calls = merge_deltas(d.tool_calls)
        content = None if calls and not d.content.strip() else (d.content or None)   # separators only
        return ChatMessageParts(d.reasoning or None, content, calls)

    def _calls(self, rd: ReasoningDelta) -> DeltaMessage:
        if self.in_reasoning is None:
            return DeltaMessage(rd.reasoning, rd.content)
        a = self.in_reasoning.feed(rd.reasoning)
        b = self.in_content.feed(rd.content) if self.in_content is not None else StreamOut(rd.content)
        out = DeltaMessage(a.content, b.content, a.calls + b.calls)
        self.num_calls += len({d.index for d in out.tool_calls if d.id is not None})
        return out


def _finish(stream: ToolCallStream | None) -> StreamOut:
    return stream.finish() if stream is not None else StreamOut()


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when a choice that called tools stopped on its own."""
    return "tool_calls" if made_calls and reason == "stop" else reason
