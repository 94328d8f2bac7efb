"""Tool-call parsers (`--tool-call-parser NAME`) and the grammars of `tool_choice`.

    hermes      Qwen3's JSON calls:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    qwen3_xml   Qwen3.5's XML calls: <tool_call><function=NAME><parameter=P>v</parameter>...
"""

from __future__ import annotations

from backboard.server.tool_parsers.base import (
    CallIndex,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    merge_deltas,
)
from backboard.server.tool_parsers.hermes import HermesToolParser
from backboard.server.tool_parsers.qwen_xml import QwenXmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3": HermesToolParser,
    "qwen3_xml": QwenXmlToolParser,
    "qwen3_coder": QwenXmlToolParser,
    "qwen3_5": QwenXmlToolParser,
}


def tool_parser_class(name: str) -> type[ToolParser]:
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return cls


__all__ = ["TOOL_PARSERS", "CallIndex", "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolParser",
           "merge_deltas", "tool_parser_class"]
