"""/v1/responses through `backboard serve` with the openai client (`client.responses.create`, whole
and streamed; `client.responses.stream`, whose accumulator rejects out-of-order or inconsistent
events): text, instructions and input items rendered like the same chat, structured output,
function calls, reasoning, and 400s naming the field. On the tiny random-weight hybrid, so valid
JSON and calls are the grammar's doing; greedy, so the chat endpoint is the oracle."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.conftest import SERVED_NAME, start_server
from tests.e2e.test_structured_output import SCHEMAS, TOOLS, check

RESP_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ASK = "What is the weather in Paris for the next 3 days?"


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):
    s = start_server(server_model, tmp_path_factory.mktemp("responses"), "--max-model-len", "1024",
                     "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_xml")
    yield s
    assert s.stop() == 0, s.log()[-3000:]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def create(server, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 40)
    return client(server).responses.create(model=SERVED_NAME, input=kw.pop("input", ASK), **kw)


def streamed(server, **kw):
    """(the final Response, the event types in order, text deltas by event type). The accumulated
    one when the response completed; an incomplete one (max_output_tokens) ends with
    response.incomplete, which carries it, as OpenAI's does."""
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 40)
    types, deltas = [], {}
    with client(server).responses.stream(model=SERVED_NAME, input=kw.pop("input", ASK), **kw) as s:
        for ev in s:
            types.append(ev.type)
            if ev.type.endswith(".delta"):
                deltas[ev.type] = deltas.get(ev.type, "") + ev.delta
            assert ev.sequence_number == len(types) - 1
        final = s.get_final_response() if ev.type == "response.completed" else ev.response
    return final, types, deltas


def chat(server, messages, **kw):
    return client(server).chat.completions.create(model=SERVED_NAME, messages=messages, temperature=0, **kw)


def test_text_whole_and_streamed_match_chat(server):
    r = create(server)
    ref = chat(server, [{"role": "user", "content": ASK}], max_tokens=40)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == ref.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert r.status == ("incomplete" if ref.choices[0].finish_reason == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    final, types, deltas = streamed(server)
    assert final.output_text == r.output_text == deltas["response.output_text.delta"]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response." + r.status
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 1
    # the raw stream (no accumulator) carries the same text
    raw = [e for e in create(server, stream=True)]
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == r.output_text
    assert raw[-1].response.output[0].content[0].text == r.output_text


def test_instructions_and_input_items_render_like_chat(server):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": json.dumps({"city": "Paris", "days": 3})}
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                              "text": "use the tool"}]},
             call, {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24C"}]
    r = create(server, input=items, instructions="Be brief.", tools=RESP_TOOLS, max_output_tokens=4)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK},
                {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}]
    ref = chat(server, messages, tools=TOOLS, max_tokens=4)
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    bare = chat(server, messages[1:2], max_tokens=1)
    assert r.usage.input_tokens > bare.usage.prompt_tokens + 20      # the history and tools are in it


def test_json_schema_text_format(server):
    fmt = {"format": {"type": "json_schema", "name": "flat", "schema": SCHEMAS["flat"], "strict": True}}
    r = create(server, text=fmt, max_output_tokens=160)
    assert r.status == "completed"
    check(json.loads(r.output_text), SCHEMAS["flat"])
    final, _, _ = streamed(server, text=fmt, max_output_tokens=160)
    assert final.output_text == r.output_text
    assert isinstance(json.loads(create(server, text={"format": {"type": "json_object"}},
                                        max_output_tokens=300).output_text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}])
def test_function_calls(server, choice):
    schemas = {t["name"]: t["parameters"] for t in RESP_TOOLS}
    r = create(server, tools=RESP_TOOLS, tool_choice=choice, parallel_tool_calls=False, max_output_tokens=160)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and r.output_text == "", r.output
    c = calls[0]
    assert c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed"
    check(json.loads(c.arguments), schemas[c.name])
    if isinstance(choice, dict):
        assert c.name == "add"
    final, types, deltas = streamed(server, tools=RESP_TOOLS, tool_choice=choice, parallel_tool_calls=False,
                                    max_output_tokens=160)
    got = [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"]
    assert got == [(c.name, json.loads(c.arguments))]
    assert json.loads(deltas["response.function_call_arguments.delta"]) == json.loads(c.arguments)
    assert "response.function_call_arguments.done" in types


def test_reasoning_whole_and_streamed(server):
    r = create(server, reasoning={"effort": "high"}, max_output_tokens=24)
    ref = chat(server, [{"role": "user", "content": ASK}], max_tokens=24,
               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    # the prompt opened <think>; a random model never closes it: all reasoning
    assert [o.type for o in r.output] == ["reasoning"] and r.status == "incomplete"
    text = r.output[0].content[0].text
    assert text == ref.choices[0].message.reasoning_content and text
    final, types, deltas = streamed(server, reasoning={"effort": "high"}, max_output_tokens=24)
    assert deltas["response.reasoning_text.delta"] == text
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == text
    assert "response.reasoning_text.done" in types
    off = create(server, reasoning={"effort": "none"}, max_output_tokens=8)
    assert [o.type for o in off.output] == ["message"]


LOGPROBS = dict(include=["message.output_text.logprobs"], top_logprobs=3)


def _lps(entries) -> list:
    return [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in entries]


def test_logprobs_whole_and_streamed_match_chat(server):
    r = create(server, max_output_tokens=12, **LOGPROBS)
    ref = chat(server, [{"role": "user", "content": ASK}], max_tokens=12, logprobs=True, top_logprobs=3)
    want = _lps(ref.choices[0].logprobs.content)
    part = r.output[0].content[0]
    assert _lps(part.logprobs) == want and want
    assert all(len(t.top_logprobs) == 3 and t.bytes for t in part.logprobs)
    assert create(server, max_output_tokens=4).output[0].content[0].logprobs == []     # not asked for
    streamed_lps = []
    for ev in create(server, stream=True, max_output_tokens=12, **LOGPROBS):
        if ev.type == "response.output_text.delta":
            streamed_lps += [(t.token, t.logprob) for t in ev.logprobs]
        elif ev.type == "response.output_text.done":
            assert [(t.token, t.logprob) for t in ev.logprobs] == [w[:2] for w in want]
    assert streamed_lps == [w[:2] for w in want]


def test_store_and_previous_response_id_continue_the_conversation(server):
    first = create(server, input="My name is Ada.", max_output_tokens=6)
    assert first.store is True
    follow = create(server, input="What is my name?", previous_response_id=first.id, max_output_tokens=6)
    assert follow.previous_response_id == first.id
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    ref = chat(server, history, max_tokens=6)
    assert follow.usage.input_tokens == ref.usage.prompt_tokens
    assert follow.output_text == ref.choices[0].message.content
    # streamed, and a chain of three
    final, _, _ = streamed(server, input="And again?", previous_response_id=follow.id, max_output_tokens=4)
    third = create(server, input="Thanks.", previous_response_id=final.id, max_output_tokens=2)
    assert third.usage.input_tokens > follow.usage.input_tokens + 8
    # GET and DELETE
    c = client(server)
    assert c.responses.retrieve(follow.id).output_text == follow.output_text
    c.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(follow.id)
    unstored = create(server, input="Forget this.", store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        create(server, input="x", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("kw, param", [
    ({"previous_response_id": "resp_x"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}}, "text"),
    ({"tools": RESP_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_requests_are_400s_naming_the_field(server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        create(server, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert create(server, max_output_tokens=2).status == "incomplete"          # still serving
