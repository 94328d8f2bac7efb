"""Qwen3.5 / Qwen3.6 / Qwen3-Coder's XML format (their chat templates' `<tool_call>` section):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are text; the tool's JSON schema says what each becomes (a string stays a string; integer,
number, boolean, object, array and null values are parsed; a parameter the schema does not know is
parsed when it reads as JSON and kept as a string otherwise). The arguments stream one parameter at
a time: `{"city": "Paris"` when the first closes, `, "days": 3` after the next, `}` at the end."""

from __future__ import annotations

import json
import re
from typing import Any

from backboard.server.tool_parsers.base import CallState, ToolCallDelta, ToolParser, dumps

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>")
_PARAM_END = re.compile(r"</parameter>|(?=</function>)|(?=\n?<parameter=)")
_FUNCTION_END = re.compile(r"\s*</function>")


class QwenXmlCall(CallState):
    def __init__(self, index: int, schemas: dict[str, dict]) -> None:
        super().__init__(index, schemas)
        self.name: str | None = None
        self.at = 0                       # how far the body is parsed
        self.num_params = 0
        self.closed = False

    def update(self, body: str, complete: bool) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        if self.name is None:
            m = _FUNCTION.match(body)
            if m is None:
                self.failed = complete
                return out
            self.name, self.at = m.group(1).strip(), m.end()
            out.append(self._name(self.name))
        while not self.closed:
            piece = self._next(body)
            if piece is None:
                break
            if piece:
                out.append(ToolCallDelta(self.index, arguments=piece))
        if complete and not self.closed:
            self.closed = True
            out.append(ToolCallDelta(self.index, arguments="}" if self.num_params else "{}"))
        return out

    def _next(self, body: str) -> str | None:
        """The argument text of the next finished parameter or of </function>; None: need more."""
        m = _FUNCTION_END.match(body, self.at)
        if m is not None:
            self.at, self.closed = m.end(), True
            return "}" if self.num_params else "{}"
        m = _PARAM.match(body, self.at)
        if m is None:
            return None
        end = _PARAM_END.search(body, m.end())
        if end is None:
            return None
        key = m.group(1).strip()
        value = _strip_newlines(body[m.end():end.start()])
        self.at = end.end()
        text = ("{" if self.num_params == 0 else ", ") + dumps(key) + ": " + dumps(self._convert(key, value))
        self.num_params += 1
        return text

    def _convert(self, key: str, value: str) -> Any:
        schema = ((self.schemas.get(self.name or "") or {}).get("properties") or {}).get(key)
        return convert_value(value, schema)


def _strip_newlines(v: str) -> str:
    """The template puts the value on lines of its own."""
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


def convert_value(value: str, schema: dict | None) -> Any:
    """A parameter's text as the JSON value its schema calls for (see the module's docstring)."""
    types = _types(schema)
    if types and types <= {"string"}:
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return _loose(value, types)
    if not types or _fits(parsed, types):
        return parsed
    return value if "string" in types else parsed


def _types(schema: dict | None) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, list):
        return set(t)
    if isinstance(t, str):
        return {t}
    if "enum" in schema and all(isinstance(e, str) for e in schema["enum"]):
        return {"string"}
    return set()


def _fits(v: Any, types: set[str]) -> bool:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
             dict: "object", type(None): "null"}
    k = kinds.get(type(v))
    return k in types or (k == "integer" and "number" in types)


def _loose(value: str, types: set[str]) -> Any:
    """Values that are not JSON: Python-style booleans / None, numbers with spaces around."""
    v = value.strip()
    if "boolean" in types and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if "null" in types and v.lower() in ("none", "null"):
        return None
    for kind, cast in (("integer", int), ("number", float)):
        if kind in types:
            try:
                return cast(v)
            except ValueError:
                pass
    return value


class QwenXmlToolParser(ToolParser):
    name = "qwen3_xml"
    structural_tag_model = "qwen_3_5"
    call_class = QwenXmlCall
