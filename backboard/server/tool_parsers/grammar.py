"""The grammar of `tool_choice`: "required" (one or more calls, of any tools, nothing else) and a
named function (exactly one call of it) constrain the output to the parser's call format, each call's arguments to
its tool's JSON schema, so even a small model returns calls that parse. xgrammar builds the
structural tag of each model family's format; "auto" and "none" need no grammar."""

from __future__ import annotations

from typing import Any

from backboard.sample.grammar import GrammarError, check_structured_outputs
from backboard.sampling_params import StructuredOutputsParams
from backboard.server.tool_parsers.base import ToolParser

MAX_WHITESPACE = 2      # per gap in the arguments: a weak model given free whitespace never stops


def named_tool(tool_choice: Any) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name": ...}}), if any."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") or {}
        return fn.get("name") or tool_choice.get("name")
    return None


def tool_choice_grammar(parser: type[ToolParser], tools: list[dict], tool_choice: Any,
                        parallel_tool_calls: bool = True) -> StructuredOutputsParams | None:
    """The structured-output spec that enforces tool_choice (None for auto / none). Raises
    GrammarError naming `tools` when a tool's parameters make no grammar."""
    if tool_choice in (None, "auto", "none"):
        return None
    import xgrammar

    name = named_tool(tool_choice)
    choice = {"type": "function", "function": {"name": name}} if name else "required"
    try:
        tag = xgrammar.get_model_structural_tag(
            parser.structural_tag_model, tools=tools, tool_choice=choice, reasoning="disabled",
            parallel_tool_calls=parallel_tool_calls and name is None, max_whitespace_cnt=MAX_WHITESPACE)
    except Exception as e:  # noqa: BLE001 - pydantic / ValueError on a malformed tool
        raise GrammarError(f"invalid tools for tool_choice: {e}", "tools") from e
    fmt = tag.format
    if isinstance(fmt, xgrammar.structural_tag.TriggeredTagsFormat):
        # "required": calls only, one per line, then the end (xgrammar's form allows free text
        # after the calls, which a weak model fills up to max_tokens)
        tag.format = xgrammar.structural_tag.TagsWithSeparatorFormat(
            tags=fmt.tags, separator="\n", at_least_one=True, stop_after_first=fmt.stop_after_first)
    so = StructuredOutputsParams(structural_tag=tag.model_dump_json())
    check_structured_outputs(so, "tools")
    return so
