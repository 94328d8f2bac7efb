"""The hermes format (Qwen3, Qwen2.5, Hermes):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The name goes out once its string closes; the arguments stream as the model writes them (its own
JSON text, cut where the value ends)."""

from __future__ import annotations

import json
import re

from backboard.server.tool_parsers.base import CallState, ToolCallDelta, ToolParser, dumps

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(?=\S)')


class JsonValueEnd:
    """Where a JSON object, array or string ends in text that arrives in pieces."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.done = 0, False, False, False

    def scan(self, text: str) -> int:
        """Characters of `text` that belong to the value (all of them until it ends)."""
        for i, ch in enumerate(text):
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            if self.depth == 0 and not self.in_str:
                self.done = True
                return i + 1
        return len(text)


class JsonStrings:
    """Whether text that arrives in pieces is inside a JSON string at its end."""

    def __init__(self) -> None:
        self.at, self.in_str, self.esc = 0, False, False

    def advance(self, text: str) -> None:
        """Scan what `text` (the whole text so far) adds since the last call."""
        for ch in text[self.at:]:
            self.in_str, self.esc = _after(ch, self.in_str, self.esc)
        self.at = len(text)

    def find_outside(self, text: str, marker: str) -> int:
        """The first `marker` in `text` (which follows what was advanced over) outside a string."""
        in_str, esc = self.in_str, self.esc
        for i, ch in enumerate(text):
            if not in_str and text.startswith(marker, i):
                return i
            in_str, esc = _after(ch, in_str, esc)
        return -1


def _after(ch: str, in_str: bool, esc: bool) -> tuple[bool, bool]:
    """(in a string, escaped) after `ch`."""
    if not in_str:
        return ch == '"', False
    if esc:
        return True, False
    return ch != '"', ch == "\\"


class HermesCall(CallState):
    """The call ends at the first `</tool_call>` outside a JSON string: an argument may contain
    the tag (a grammar-constrained call is never cut there)."""

    def __init__(self, index: int, schemas: dict[str, dict]) -> None:
        super().__init__(index, schemas)
        self.args_at: int | None = None          # where the arguments value starts in the body
        self.sent = 0                            # argument characters sent
        self.end = JsonValueEnd()
        self.strings = JsonStrings()

    def end_at(self, body: str, text: str, end: str) -> int:
        self.strings.advance(body)
        return self.strings.find_outside(text, end)

    def update(self, body: str, complete: bool) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        if not self.sent_name:
            m = _NAME.search(body)
            if m is None:
                return self._fallback(body) if complete else out
            out.append(self._name(json.loads(f'"{m.group(1)}"')))
        if self.args_at is None:
            m = _ARGS.search(body)
            if m is None:
                if complete:
                    out.append(ToolCallDelta(self.index, arguments="{}"))
                return out
            self.args_at = m.end()
        if not self.end.done:
            new = body[self.args_at + self.sent:]
            n = self.end.scan(new)
            if n:
                out.append(ToolCallDelta(self.index, arguments=new[:n]))
                self.sent += n
        return out

    def _fallback(self, body: str) -> list[ToolCallDelta]:
        """A complete body without a recognisable name: a call if it is JSON with one."""
        try:
            obj = json.loads(body.strip())
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            self.failed = True
            return []
        return [self._name(str(name)), ToolCallDelta(self.index, arguments=dumps(args))]


class HermesToolParser(ToolParser):
    name = "hermes"
    structural_tag_model = "qwen_3"
    call_class = HermesCall
