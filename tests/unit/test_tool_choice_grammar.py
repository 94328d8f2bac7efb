"""tool_choice grammars agree with their parsers: what the grammar of "required" / a named function
lets through parses into calls whose arguments fit the tools' schemas, and nothing else gets
through."""

from __future__ import annotations

import json

import pytest

from backboard.sample.grammar import GrammarError, to_grammar
from backboard.server.tool_parsers import HermesToolParser, QwenXmlToolParser
from backboard.server.tool_parsers.grammar import named_tool, tool_choice_grammar

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
CALLS = {
    HermesToolParser: ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
                       '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'],
    QwenXmlToolParser: ["<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                        "<tool_call>\n<function=noop>\n\n</function>\n</tool_call>"],
}


def accepts(so, text: str) -> bool:
    """Whether the grammar's language holds `text` (a byte-level matcher, no tokenizer)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([chr(i) for i in range(32, 127)] + ["\n"])
    m = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(to_grammar(so)))
    return m.accept_string(text) and m.is_completed()


@pytest.mark.parametrize("parser", [HermesToolParser, QwenXmlToolParser])
def test_required_and_named_grammars_match_the_parser(parser):
    weather, noop = CALLS[parser]
    required = tool_choice_grammar(parser, TOOLS, "required")
    named = tool_choice_grammar(parser, TOOLS, {"type": "function", "function": {"name": "noop"}})
    assert accepts(required, weather) and accepts(required, noop) and accepts(required, weather + "\n" + noop)
    assert not accepts(required, "Sure, " + weather) and not accepts(required, "")
    assert not accepts(required, weather + " and some text")                 # calls only
    assert not accepts(required, weather.replace("2", '"two"'))          # arguments follow the schema
    assert accepts(named, noop) and not accepts(named, weather)
    for text in (weather, noop):
        content, calls = parser(TOOLS).parse(text)
        assert content == "" and len(calls) == 1
        assert isinstance(json.loads(calls[0].arguments), dict)


def test_auto_and_none_need_no_grammar():
    assert tool_choice_grammar(QwenXmlToolParser, TOOLS, "auto") is None
    assert tool_choice_grammar(QwenXmlToolParser, TOOLS, "none") is None
    assert named_tool({"type": "function", "function": {"name": "x"}}) == "x"


def test_bad_tool_schema_is_a_grammar_error_naming_tools():
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]
    with pytest.raises(GrammarError) as e:
        tool_choice_grammar(HermesToolParser, bad, "required")
    assert e.value.param == "tools"
