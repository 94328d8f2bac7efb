"""The server through the official `openai` client: completions and chat, streaming and not."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, SERVED_NAME

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(api_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server_model):
    from backboard.engine.tokenizer import Tokenizer

    return Tokenizer(server_model)


def _stream_completion(client, **kw):
    """(text, number of token chunks, final usage, finish reasons) of a streamed completion."""
    text, n_chunks, usage, finish = [], 0, None, []
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            n_chunks += 1
            text.append(chunk.choices[0].text)
            if chunk.choices[0].finish_reason:
                finish.append(chunk.choices[0].finish_reason)
        else:
            assert usage is None, "one usage chunk"
            usage = chunk.usage
    return "".join(text), n_chunks, usage, finish


def test_health_and_models(api_server):
    assert httpx.get(api_server.url + "/health").status_code == 200
    r = httpx.get(api_server.url + "/v1/models", headers=api_server.headers)
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [SERVED_NAME]
    assert data["data"][0]["object"] == "model" and data["data"][0]["max_model_len"] == 512


def test_completion_stream_equals_non_stream(client, tokenizer):
    prompt = "The engine serves a batch of requests"
    full = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=12, **GREEDY)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.model == SERVED_NAME and len(full.choices) == 1
    c = full.choices[0]
    assert c.index == 0 and c.finish_reason == "length" and c.text
    n_prompt = len(tokenizer.encode(prompt))
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == n_prompt + 12

    text, n_chunks, usage, finish = _stream_completion(client, model=SERVED_NAME, prompt=prompt,
                                                       max_tokens=12, **GREEDY)
    assert text == c.text
    assert n_chunks == 12                              # stream interval 1: one chunk per token
    assert finish == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n_prompt, 12, n_prompt + 12)


def test_completion_token_id_prompt(client, tokenizer):
    ids = tokenizer.encode("a prompt given as token ids")
    by_ids = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=6, **GREEDY)
    by_text = client.completions.create(model=SERVED_NAME, prompt="a prompt given as token ids",
                                        max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    nested = client.completions.create(model=SERVED_NAME, prompt=[ids], max_tokens=6, **GREEDY)
    assert nested.choices[0].text == by_text.choices[0].text


def test_chat_stream_equals_non_stream(client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a kernel."}]
    full = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=10, **GREEDY)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    n_prompt = len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 10)

    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True},
                                                 **GREEDY))
    token_chunks = [c for c in chunks if c.choices]
    assert token_chunks[0].choices[0].delta.role == "assistant"
    assert token_chunks[0].choices[0].delta.content is not None     # the role comes with a token
    assert all(c.choices[0].delta.role is None for c in token_chunks[1:])
    assert len(token_chunks) == 10
    assert "".join(c.choices[0].delta.content or "" for c in token_chunks) == msg.content
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_max_completion_tokens_and_content_parts(client):
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_completion_tokens=3, max_tokens=50, **GREEDY)
    assert r.usage.completion_tokens == 3


def test_completion_logprobs(client):
    kw = dict(model=SERVED_NAME, prompt="logprobs please", max_tokens=5, logprobs=2, **GREEDY)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 1 <= len(top) <= 3 and top[tok] == pytest.approx(val)
        assert max(top.values()) >= val - 1e-6        # greedy: the chosen token is the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and isinstance(item.bytes, list)
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token or item.token == "\ufffd"
    none = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2, **GREEDY)
    assert none.choices[0].logprobs is None


def test_n_completions(client):
    r = client.completions.create(model=SERVED_NAME, prompt="fan out", max_tokens=6, n=3, temperature=1.0,
                                  seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    chunks = list(client.completions.create(model=SERVED_NAME, prompt="fan out", max_tokens=6, n=3,
                                            temperature=1.0, seed=7, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts = {0: "", 1: "", 2: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == {c.index: c.text for c in r.choices}        # seeded: same samples
    assert chunks[-1].usage.completion_tokens == 18


def test_seed_reproducible(client):
    kw = dict(model=SERVED_NAME, prompt="sample", max_tokens=8, temperature=1.0, top_p=0.9,
              seed=1234, extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string(client):
    base = client.completions.create(model=SERVED_NAME, prompt="stop here", max_tokens=16, **GREEDY)
    text = base.choices[0].text
    mid = len(text) // 2
    starts = [i for i in range(mid, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalnum()]
    assert starts, f"need an ASCII stop string in the second half of {text!r}"
    stop = text[starts[0]:starts[0] + 2]
    cut = text[:text.index(stop)]
    r = client.completions.create(model=SERVED_NAME, prompt="stop here", max_tokens=16, stop=[stop], **GREEDY)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    s_text, _, usage, finish = _stream_completion(client, model=SERVED_NAME, prompt="stop here",
                                                  max_tokens=16, stop=stop, **GREEDY)
    assert s_text == cut and finish == ["stop"] and usage.completion_tokens == r.usage.completion_tokens
    inc = client.completions.create(model=SERVED_NAME, prompt="stop here", max_tokens=16, stop=[stop],
                                    temperature=0.0,
                                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert inc.choices[0].text == cut + stop


def test_prompt_logprobs(api_server, tokenizer):
    ids = tokenizer.encode("prompt logprobs")
    r = httpx.post(api_server.url + "/v1/completions", headers=api_server.headers, timeout=60,
                   json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 1, "temperature": 0})
    assert r.status_code == 200
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    assert all(str(t) in d for t, d in zip(ids[1:], plp[1:]))


def test_tokenize_detokenize(api_server, tokenizer):
    h = api_server.headers
    r = httpx.post(api_server.url + "/tokenize", headers=h, json={"model": SERVED_NAME, "prompt": "hello tokens",
                                                                   "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode("hello tokens") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and len(body["token_strs"]) == body["count"]
    d = httpx.post(api_server.url + "/detokenize", headers=h, json={"tokens": body["tokens"]})
    assert d.status_code == 200 and d.json() == {"prompt": "hello tokens"}
    messages = [{"role": "user", "content": "hi"}]
    c = httpx.post(api_server.url + "/tokenize", headers=h, json={"messages": messages})
    assert c.json()["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages))


def test_completion_return_token_ids(client, tokenizer):
    """vLLM's return_token_ids: each choice (each streamed chunk) carries its new token ids,
    which decode to its text (a client resending a conversation needs the exact ids)."""
    kw = dict(model=SERVED_NAME, prompt="return the ids", max_tokens=7, **GREEDY)
    kw["extra_body"] = {**kw["extra_body"], "return_token_ids": True}
    full = client.completions.create(**kw).choices[0]
    ids = full.model_extra["token_ids"]
    assert len(ids) == 7 and tokenizer.decode(ids) == full.text
    chunks = [c.choices[0].model_extra["token_ids"] for c in client.completions.create(stream=True, **kw)
              if c.choices]
    assert [t for c in chunks for t in c] == ids and all(len(c) == 1 for c in chunks)
    plain = client.completions.create(model=SERVED_NAME, prompt="return the ids", max_tokens=2, **GREEDY)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


def test_chat_system_prompt_is_checkpointed_for_the_next_conversation(client, tokenizer):
    """The server hints where a chat's system message ends: the next conversation with the same
    system prompt (and another question) resumes after it. Without the hint the first request
    leaves no state there and the second recomputes everything (cached_tokens 0)."""
    system = {"role": "system", "content": " ".join(f"rule {i}: answer briefly and politely" for i in range(12))}
    n_sys = len(tokenizer.encode(tokenizer.apply_chat_template([system], False)))
    usage = [client.chat.completions.create(model=SERVED_NAME, max_tokens=2, messages=[
        system, {"role": "user", "content": q}], **GREEDY).usage for q in ("Who are you?", "What is 2 + 2?")]
    assert n_sys > 32 and usage[0].prompt_tokens > n_sys
    assert usage[1].prompt_tokens_details.cached_tokens == n_sys - 1, (usage, n_sys)


def test_unknown_fields_and_user_are_ignored(client):
    r = client.completions.create(model=SERVED_NAME, prompt="extra", max_tokens=2, user="someone",
                                  extra_body={"not_a_field": {"x": 1}, "best_of": 1}, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_prefix_cache_usage_metrics_and_startup_line(client, api_server, tokenizer):
    """The same long prompt twice: the second answer is the same, its usage says how many prompt
    tokens the cache served (non-streamed and streamed), /metrics counts them, and the start-up
    line says how many state checkpoints fit (prefix caching is on by default)."""
    prompt = " ".join(f"turn {i}: the assistant keeps the conversation history" for i in range(8))
    n_prompt = len(tokenizer.encode(prompt))
    before = api_server.metrics().get("backboard:prefix_cache_hits_total", 0.0)
    first = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, **GREEDY)
    again = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, **GREEDY)
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert n_prompt - 16 <= cached <= n_prompt - 1, (cached, n_prompt)
    text, _, usage, _ = _stream_completion(client, model=SERVED_NAME, prompt=prompt, max_tokens=6, **GREEDY)
    assert text == first.choices[0].text and usage.prompt_tokens_details.cached_tokens >= cached
    deadline = time.time() + 10               # engine stats reach /metrics at most every 0.5 s
    while api_server.metrics().get("backboard:prefix_cache_hits_total", 0.0) < before + 2 * cached:
        assert time.time() < deadline, api_server.metrics()
        time.sleep(0.2)
    m = api_server.metrics()
    assert 0 < m["backboard:prefix_cache_hit_rate"] <= 1 and m["backboard:prefix_cache_state_checkpoints"] >= 1
    assert re.search(r"\d+ more for prefix-cache state checkpoints\); prefix caching on", api_server.log())
