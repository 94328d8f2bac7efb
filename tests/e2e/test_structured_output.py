"""Structured output, tool calls and reasoning through `backboard serve` with the openai client, on
the tiny random-weight hybrid (its free text is gibberish: every valid JSON or call below is the
grammar's doing), with speculation off, MTP and n-gram (greedy output identical)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.e2e.conftest import SERVED_NAME, start_server

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                   "admin": {"type": "boolean"}},
                  "required": ["name", "admin"]},
        "status": {"enum": ["open", "closed", "pending"]}},
        "required": ["id", "owner", "status"]},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "points": {"type": "array", "items": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "number"}},
            "required": ["x"]}, "maxItems": 2}},
        "required": ["tags", "points"]},
    "flat": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                              "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                              "metric": {"type": "boolean"}},
             "required": ["city", "days", "metric"]},
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
COMMON = ("--max-model-len", "1024", "--max-num-seqs", "32", "--reasoning-parser", "qwen3")


def check(value, schema) -> None:
    """A small JSON-schema validator for the keywords used here."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
        return
    t = schema["type"]
    if t == "object":
        assert isinstance(value, dict) and set(schema.get("required", ())) <= set(value)
        assert set(value) <= set(schema["properties"])
        for k, v in value.items():
            check(v, schema["properties"][k])
    elif t == "array":
        assert isinstance(value, list)
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
        for v in value:
            check(v, schema["items"])
    elif t == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", -1 << 60) <= value <= schema.get("maximum", 1 << 60)
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
    elif t == "boolean":
        assert isinstance(value, bool)


@pytest.fixture(scope="module")
def servers(server_model, tmp_path_factory):
    """Speculation off (XML tool calls), MTP (hermes tool calls), n-gram (XML tool calls)."""
    d = tmp_path_factory.mktemp("structured")
    made = {"off": start_server(server_model, d, *COMMON, "--tool-call-parser", "qwen3_xml"),
            "mtp": start_server(server_model, d, *COMMON, "--tool-call-parser", "hermes", "--speculative-config",
                                '{"method": "mtp", "num_speculative_tokens": 3}'),
            "ngram": start_server(server_model, d, *COMMON, "--tool-call-parser", "qwen3_xml", "--speculative-config",
                                  '{"method": "ngram", "num_speculative_tokens": 3}')}
    yield made
    for s in made.values():
        assert s.stop() == 0, s.log()[-3000:]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def chat(server, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 160)
    return client(server).chat.completions.create(model=SERVED_NAME, messages=kw.pop("messages", ASK), **kw)


def stream_chat(server, **kw):
    """(content, reasoning, {index: (name, arguments)}, finish_reason) of a streamed chat."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in chat(server, stream=True, **kw):
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for t in d.tool_calls or ():
            name, args = calls.get(t.index, (None, ""))
            calls[t.index] = (t.function.name or name, args + (t.function.arguments or ""))
        finish = c.finish_reason or finish
    return content, reasoning, calls, finish


def json_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


# ---- structured output ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_valid_from_random_weights(servers, name):
    r = chat(servers["off"], response_format=json_format(name))
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    check(json.loads(c.message.content), SCHEMAS[name])
    content, reasoning, _, finish = stream_chat(servers["off"], response_format=json_format(name))
    assert content == c.message.content and finish == "stop" and reasoning == ""


def test_other_constraints(servers):
    s = servers["off"]
    assert chat(s, extra_body={"guided_choice": ["red pill", "blue pill"]}).choices[0].message.content in (
        "red pill", "blue pill")
    import re
    text = chat(s, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2,5}"}).choices[0].message.content
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text), text
    obj = json.loads(chat(s, response_format={"type": "json_object"}, max_tokens=300).choices[0].message.content)
    assert isinstance(obj, dict)
    text = chat(s, extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'}}
                ).choices[0].message.content
    assert re.fullmatch(r"yes|no|maybe [0-9]", text), text
    comp = client(s).completions.create(model=SERVED_NAME, prompt="A record:", max_tokens=160, temperature=0,
                                        extra_body={"guided_json": SCHEMAS["flat"]})
    check(json.loads(comp.choices[0].text), SCHEMAS["flat"])


def test_unsatisfiable_within_max_tokens_ends_with_length(servers):
    c = chat(servers["off"], response_format=json_format("nested"), max_tokens=4).choices[0]
    assert c.finish_reason == "length" and c.message.content.startswith("{")


def test_sampled_json_is_valid_too(servers):
    r = chat(servers["off"], response_format=json_format("arrays"), temperature=1.0, n=3, seed=7)
    for c in r.choices:
        check(json.loads(c.message.content), SCHEMAS["arrays"])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_specs_are_400s_naming_the_field(servers, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers["off"], max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    assert chat(servers["off"], max_tokens=2).choices[0].finish_reason == "length"     # still serving


# ---- tool calls ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["off", "mtp"])      # qwen3_xml, hermes
def test_required_and_named_calls_parse(servers, kind):
    s = servers[kind]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        # one call: with parallel calls a random model goes on calling until max_tokens
        r = chat(s, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        assert c.message.content is None
        for call in c.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            check(json.loads(call.function.arguments), schemas[call.function.name])
        if choice != "required":
            assert [t.function.name for t in c.message.tool_calls] == ["add"]
        content, _, calls, finish = stream_chat(s, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        assert finish == "tool_calls"
        assert [(n, json.loads(a)) for n, a in calls.values()] == [
            (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]


def test_parallel_required_calls_parse(servers):
    c = chat(servers["off"], tools=TOOLS, tool_choice="required", max_tokens=200).choices[0]
    calls = c.message.tool_calls
    assert len(calls) >= 1 + (c.finish_reason == "length")
    for call in calls[:-1] if c.finish_reason == "length" else calls:    # the last may be cut short
        args = json.loads(call.function.arguments)
        check(args, next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name))


def test_tool_results_go_through_the_chat_template(servers, server_model):
    from transformers import AutoTokenizer

    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}]
    r = chat(servers["off"], messages=history, tools=TOOLS, max_tokens=3)
    tok = AutoTokenizer.from_pretrained(server_model)
    conv = history[:1] + [dict(history[1], tool_calls=[{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}])] + history[2:]
    text = tok.apply_chat_template(conv, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in text and "<parameter=city>\nParis" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


# ---- reasoning ------------------------------------------------------------------------------------
def test_reasoning_split_and_grammar_after_it(servers):
    s = servers["off"]
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    r = chat(s, max_tokens=24, response_format=json_format("flat"), extra_body=think)
    c = r.choices[0]
    # the prompt opened the block; a random model never closes it: all reasoning, unconstrained
    assert c.finish_reason == "length" and c.message.content is None
    assert c.message.reasoning_content and not c.message.reasoning_content.startswith("{")
    content, reasoning, _, _ = stream_chat(s, max_tokens=24, response_format=json_format("flat"), extra_body=think)
    assert (content, reasoning) == ("", c.message.reasoning_content)
    # thinking off: the template closes the block, the grammar applies from the first token
    off = chat(s, response_format=json_format("flat"), extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    check(json.loads(off.choices[0].message.content), SCHEMAS["flat"])


# ---- speculation ---------------------------------------------------------------------------------
def test_greedy_identical_with_mtp_and_ngram(servers):
    requests = [dict(response_format=json_format(n)) for n in sorted(SCHEMAS)] + [
        dict(extra_body={"guided_regex": r"([0-9]{2}-[a-z]{3} ){4}"}),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        dict(max_tokens=40)]
    for kw in requests:
        want = chat(servers["off"], **kw).choices[0]
        for kind in ("mtp", "ngram"):
            got = chat(servers[kind], **kw).choices[0]
            if "tools" in kw and kind == "mtp":        # hermes there: compare the calls
                assert [(t.function.name, json.loads(t.function.arguments)) for t in got.message.tool_calls]
                continue
            assert (got.message.content, got.message.tool_calls and [
                (t.function.name, t.function.arguments) for t in got.message.tool_calls]) == (
                want.message.content, want.message.tool_calls and [
                    (t.function.name, t.function.arguments) for t in want.message.tool_calls]), (kind, kw)
    stats = servers["ngram"].metrics()
    assert any(k.startswith("backboard:spec_decode_num_draft_tokens") and v > 0 for k, v in stats.items()), stats


def test_one_constrained_request_among_fifteen_free_ones_all_finish(servers):
    async def run():
        c = openai.AsyncOpenAI(base_url=servers["off"].url + "/v1", api_key="none", max_retries=0, timeout=300)
        free = [c.chat.completions.create(model=SERVED_NAME, messages=ASK, max_tokens=48, temperature=0)
                for _ in range(15)]
        constrained = c.chat.completions.create(model=SERVED_NAME, messages=ASK, max_tokens=160, temperature=0,
                                                response_format=json_format("nested"))
        return await asyncio.gather(constrained, *free)

    first, *rest = asyncio.run(run())
    check(json.loads(first.choices[0].message.content), SCHEMAS["nested"])
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 48 for r in rest)
