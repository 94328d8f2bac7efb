"""The reasoning parser and the tool-call parsers: whole outputs, and the same outputs fed in every
chunking (streamed text cut anywhere, markers included) giving the same result."""

from __future__ import annotations

import json

import pytest

from backboard.server.chat_output import ChoiceParser
from backboard.server.reasoning import IN_CONTENT, IN_REASONING, MAY_OPEN, Qwen3ReasoningParser
from backboard.server.tool_parsers import CallIndex, HermesToolParser, QwenXmlToolParser, merge_deltas
from backboard.server.tool_parsers.qwen_xml import convert_value

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "where": {"type": "object"},
                                     "zip": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


class FakeTok:
    def get_vocab(self):
        return {"<think>": 5, "</think>": 6}


def chunkings(text: str):
    yield [text]
    for n in (1, 2, 3, 7):
        yield [text[i:i + n] for i in range(0, len(text), n)]


def run_reasoning(text: str, state: str, chunks):
    s = Qwen3ReasoningParser(FakeTok()).stream(state)
    r = c = ""
    for ch in chunks:
        d = s.feed(ch)
        r, c = r + d.reasoning, c + d.content
    d = s.finish()
    return r + d.reasoning, c + d.content


# ---- reasoning --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, state, want", [
    ("\nI think so.\n</think>\n\nYes.", IN_REASONING, ("I think so.", "Yes.")),       # Qwen3.5, think on
    ("<think>\nhm, a < b\n</think>\n\n{\"a\": 1}", MAY_OPEN, ("hm, a < b", '{"a": 1}')),  # Qwen3
    ("Just an answer </think> here", MAY_OPEN, ("", "Just an answer </think> here")),  # no block
    ("still thinking when max_tokens hit", IN_REASONING, ("still thinking when max_tokens hit", "")),
    ("Plain <think> text", IN_CONTENT, ("", "Plain <think> text")),                   # thinking off
    ("</thi", IN_REASONING, ("</thi", "")),                                           # partial marker
    ("\n\n</think>x", IN_REASONING, ("", "x")),
])
def test_reasoning_split_in_every_chunking(text, state, want):
    for chunks in chunkings(text):
        assert run_reasoning(text, state, chunks) == want, chunks


def test_initial_state_from_the_prompt():
    p = Qwen3ReasoningParser(FakeTok())
    assert p.initial_state([1, 2, 5]) == IN_REASONING             # the prompt opened the block
    assert p.initial_state([1, 5, 9, 6, 3]) == IN_CONTENT         # ... or closed it
    assert p.initial_state([1, 2]) == MAY_OPEN
    assert p.initial_state([1, 2], thinking=False) == IN_CONTENT
    assert p.think_token_ids == (5, 6)


# ---- tool calls -------------------------------------------------------------------------------
def run_tools(parser, text: str, chunks):
    s = parser.stream()
    content, deltas = "", []
    for ch in chunks:
        o = s.feed(ch)
        content += o.content
        deltas += o.calls
    o = s.finish()
    return content + o.content, deltas + o.calls


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}is", "days": 3, '
          '"where": {"a": [1, {"b": "\\"}"}]}}}\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n'
          '</tool_call>')


def test_hermes_in_every_chunking():
    p = HermesToolParser(TOOLS)
    for chunks in chunkings(HERMES):
        content, deltas = run_tools(p, HERMES, chunks)
        calls = merge_deltas(deltas)
        assert content == "Let me check.\n\n"
        assert [c.name for c in calls] == ["get_weather", "noop"]
        assert json.loads(calls[0].arguments) == {"city": "Par}is", "days": 3, "where": {"a": [1, {"b": '"}'}]}}
        assert json.loads(calls[1].arguments) == {}
        assert deltas[0].id and deltas[0].name == "get_weather" and deltas[0].arguments == ""
        assert all(d.name is None for d in deltas if d.id is None)


def test_hermes_streams_arguments_before_the_call_ends():
    s = HermesToolParser(TOOLS).stream()
    o = s.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [d.name for d in o.calls] == ["get_weather", None]
    assert o.calls[1].arguments == '{"city": "Pa'


def test_hermes_malformed_call_is_content():
    text = "a <tool_call>not json</tool_call> b"
    content, calls = HermesToolParser(TOOLS).parse(text)
    assert calls == [] and content == text


def test_hermes_end_tag_inside_an_argument_string_does_not_end_the_call():
    """A grammar-constrained call may carry `</tool_call>` in a string argument: the call ends at the
    first tag outside a JSON string, in every chunking."""
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b\\" </tool_call>"}}\n'
            '</tool_call> after')
    for chunks in chunkings(text):
        content, deltas = run_tools(HermesToolParser(TOOLS), text, chunks)
        calls = merge_deltas(deltas)
        assert content == " after"
        assert json.loads(calls[0].arguments) == {"city": 'a</tool_call>b" </tool_call>'}


def test_structured_output_content_is_never_read_for_calls():
    """A JSON answer (response_format with tools given, tool_choice auto) whose string holds a call
    marker comes back whole; a call inside the reasoning block is still returned."""
    answer = '{"note": "x<tool_call>y", "name": "bob"}'
    whole = ChoiceParser(None, IN_CONTENT, HermesToolParser(TOOLS), content_calls=False).whole(answer)
    assert (whole.content, whole.tool_calls) == (answer, [])
    cut = ChoiceParser(None, IN_CONTENT, HermesToolParser(TOOLS)).whole(answer)
    assert cut.content != answer                       # what a call parser on the content did
    think = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call></think>' + answer
    p = ChoiceParser(Qwen3ReasoningParser(FakeTok()), IN_REASONING, HermesToolParser(TOOLS), content_calls=False)
    whole = p.whole(think)
    assert whole.content == answer and [c.name for c in whole.tool_calls] == ["noop"]


XML = ("I will call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
       "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=where>\n"
       '{"lat": 1.5}\n</parameter>\n<parameter=zip>\n00123\n</parameter>\n</function>\n</tool_call>')


def test_qwen_xml_in_every_chunking():
    p = QwenXmlToolParser(TOOLS)
    for chunks in chunkings(XML):
        content, deltas = run_tools(p, XML, chunks)
        calls = merge_deltas(deltas)
        assert content == "I will call it.\n"
        assert len(calls) == 1 and calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments) == {"city": "New York", "days": 3, "metric": True,
                                                  "where": {"lat": 1.5}, "zip": "00123"}


def test_qwen_xml_streams_parameter_by_parameter():
    s = QwenXmlToolParser(TOOLS).stream()
    o = s.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=da")
    assert [d.name for d in o.calls] == ["get_weather", None]
    assert o.calls[1].arguments == '{"city": "Rome"'
    o = s.feed("ys>\n2\n</parameter>\n</function>\n</tool_call> after")
    assert [d.arguments for d in o.calls] == [', "days": 2', "}"] and o.content == " after"


def test_qwen_xml_no_parameters_and_truncated_call():
    content, calls = QwenXmlToolParser(TOOLS).parse("<tool_call>\n<function=noop>\n</function>\n</tool_call>")
    assert content == "" and calls[0].name == "noop" and calls[0].arguments == "{}"
    # cut by max_tokens inside a parameter: the call ends with what was complete
    content, calls = QwenXmlToolParser(TOOLS).parse(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n4")
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_parallel_calls_off_keeps_the_first():
    p = HermesToolParser(TOOLS)
    s = p.stream(CallIndex(max_calls=1))
    o1, o2 = s.feed(HERMES), s.finish()
    assert [c.name for c in merge_deltas(o1.calls + o2.calls)] == ["get_weather"]


def test_shared_index_across_channels():
    counter = CallIndex()
    p = QwenXmlToolParser(TOOLS)
    a, b = p.stream(counter), p.stream(counter)
    d1 = a.feed("<tool_call>\n<function=noop>\n</function>\n</tool_call>").calls
    d2 = b.feed("<tool_call>\n<function=noop>\n</function>\n</tool_call>").calls
    assert {d.index for d in d1} == {0} and {d.index for d in d2} == {1}


@pytest.mark.parametrize("value, schema, want", [
    ("42", {"type": "integer"}, 42), ("4.5", {"type": "number"}, 4.5), ("007", {"type": "string"}, "007"),
    ("false", {"type": "boolean"}, False), ("None", {"type": ["null", "string"]}, None),
    ("[1, 2]", {"type": "array"}, [1, 2]), ("hello", None, "hello"), ("12", None, 12),
    ("12", {"enum": ["12", "13"]}, "12"), ("x y", {"type": "integer"}, "x y"),
])
def test_convert_value(value, schema, want):
    assert convert_value(value, schema) == want
