"""The stream under load, read the way InferenceX reads it, and disconnects freeing the engine."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.e2e.conftest import SERVED_NAME

N_STREAMS = 64
MAX_TOKENS = 16


async def _read_stream(client: httpx.AsyncClient, url: str, headers: dict, payload: dict) -> dict:
    """Parse one SSE stream line by line (the InferenceX client's rules, but strict)."""
    events, token_chunks, text, usage, done_at = [], 0, [], None, None
    async with client.stream("POST", url, json=payload, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            line = line.strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data)
            if data == "[DONE]":
                done_at = len(events)
                continue
            chunk = json.loads(data)
            if chunk["choices"]:
                assert usage is None, "token chunk after the usage chunk"
                token_chunks += 1
                text.append(chunk["choices"][0]["text"])
            elif chunk.get("usage"):
                usage = chunk["usage"]
    return {"n_chunks": token_chunks, "text": "".join(text), "usage": usage,
            "done_last": done_at == len(events), "n_done": events.count("[DONE]")}


async def _run_concurrent(api_server, prompts: list[str], stream: bool) -> list:
    url = api_server.url + "/v1/completions"
    limits = httpx.Limits(max_connections=N_STREAMS + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one(p: str):
            payload = {"model": SERVED_NAME, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                       "ignore_eos": True, "best_of": 1, "logprobs": None}
            if stream:
                payload.update(stream=True, stream_options={"include_usage": True})
                return await _read_stream(client, url, api_server.headers, payload)
            r = await client.post(url, json=payload, headers=api_server.headers)
            assert r.status_code == 200, r.text
            return r.json()

        return await asyncio.gather(*(one(p) for p in prompts))


def test_64_concurrent_streams(api_server):
    prompts = [f"request number {i} says" + " hello" * (i % 5) for i in range(N_STREAMS)]
    streamed = asyncio.run(_run_concurrent(api_server, prompts, stream=True))
    whole = asyncio.run(_run_concurrent(api_server, prompts, stream=False))
    for i, (s, w) in enumerate(zip(streamed, whole)):
        assert s["n_chunks"] == MAX_TOKENS, f"stream {i}: {s['n_chunks']} token chunks"
        assert s["usage"] is not None and s["usage"]["completion_tokens"] == MAX_TOKENS
        assert s["usage"]["prompt_tokens"] == w["usage"]["prompt_tokens"]
        assert s["n_done"] == 1 and s["done_last"]
        assert s["text"] == w["choices"][0]["text"], f"stream {i} differs from the non-streamed text"
    _wait_idle(api_server)


def _wait_idle(api_server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = api_server.metrics()
        if m["backboard:num_requests_running"] == 0 and m["backboard:kv_cache_usage_perc"] == 0 \
                and m["backboard:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine did not go idle: {m}")
        time.sleep(0.1)


def _wait_running(api_server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while api_server.metrics()["backboard:num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never showed as running"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_engine(api_server):
    _wait_idle(api_server)
    before = api_server.metrics()
    payload = {"model": SERVED_NAME, "prompt": "a long story", "max_tokens": 480, "ignore_eos": True,
               "temperature": 0.0, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", api_server.url + "/v1/completions", json=payload,
                           headers=api_server.headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got == 3:
                    break
            _wait_running(api_server)
            m = api_server.metrics()
            assert m["backboard:kv_cache_usage_perc"] > 0
    # the connection is closed here, long before 480 tokens
    after = _wait_idle(api_server)
    key = 'backboard:request_success_total{finished_reason="%s"}'
    assert after[key % "abort"] == before[key % "abort"] + 1
    assert after[key % "length"] == before[key % "length"]


def test_disconnect_while_waiting_non_streaming(api_server):
    """The client gives up on a non-streaming answer after a quarter of the time it takes (timed
    first: on a fast CPU the tiny model writes 480 tokens in under half a second): the server
    aborts the request instead of finishing it."""
    _wait_idle(api_server)
    payload = {"model": SERVED_NAME, "prompt": "another long story", "max_tokens": 480,
               "ignore_eos": True, "temperature": 0.0}
    t0 = time.perf_counter()
    r = httpx.post(api_server.url + "/v1/completions", json=payload, headers=api_server.headers, timeout=120)
    full_s = time.perf_counter() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 480
    before = _wait_idle(api_server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(api_server.url + "/v1/completions", json=payload, headers=api_server.headers,
                   timeout=httpx.Timeout(10.0, read=full_s / 4))
    after = _wait_idle(api_server)
    key = 'backboard:request_success_total{finished_reason="%s"}'
    assert after[key % "abort"] == before[key % "abort"] + 1
    assert after[key % "length"] == before[key % "length"]


def test_metrics_names(api_server):
    m = api_server.metrics()
    for name in ("backboard:time_to_first_token_seconds_count", "backboard:e2e_request_latency_seconds_count",
                 "backboard:time_per_output_token_seconds_count", "backboard:request_queue_time_seconds_count",
                 "backboard:num_requests_running", "backboard:num_requests_waiting",
                 "backboard:kv_cache_usage_perc", "backboard:prompt_tokens_total",
                 "backboard:generation_tokens_total", "backboard:spec_decode_num_drafts_total",
                 "backboard:spec_decode_num_draft_tokens_total", "backboard:spec_decode_num_accepted_tokens_total"):
        assert name in m, name
    assert m["backboard:spec_decode_num_drafts_total"] == 0          # no speculation on this server
    assert m["backboard:generation_tokens_total"] > 0
    assert m["backboard:time_to_first_token_seconds_count"] > 0
    assert m['backboard:request_success_total{finished_reason="length"}'] > 0
