"""The bench client: stream parsing, and `bench serve` end to end against a fake OpenAI-compatible
streaming server (FastAPI + uvicorn in a thread).

This file doubles as a script that runs the fake server in the foreground, for the sweep tests:
    python tests/unit/test_bench_client.py --port P [--token-delay S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

# ---------------------------------------------------------------- the fake server



INFERENCEX_FIELDS = ("date", "backend", "model_id", "tokenizer_id", "best_of", "num_prompts",
                     "request_rate", "burstiness", "max_concurrency", "duration", "completed",
                     "total_input_tokens", "total_output_tokens", "request_throughput",
                     "request_goodput:", "output_throughput", "total_token_throughput",
                     "input_lens", "output_lens")


def assert_inferencex_fields(r: dict) -> None:
    """Every field InferenceX's tooling reads (the spelling is InferenceX's, colon included)."""
    for key in INFERENCEX_FIELDS:
        assert key in r, key
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99", "p99.9"):
            assert f"{stat}_{m}_ms" in r, f"{stat}_{m}_ms"

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeState:
    def __init__(self, token_delay: float = 0.002, first_token_delay: float = 0.0,
                 eos_after: int = 3) -> None:
        self.token_delay = token_delay
        self.first_token_delay = first_token_delay
        self.eos_after = eos_after  # tokens generated when ignore_eos is false
        self.fail_every = 0  # every n-th completion request answers 500
        self.bad_json = False  # a broken line in the middle of each stream
        self.send_usage = True
        self.usage_delay = 0.0  # between the last token chunk and the usage chunk
        self.requests: list[dict] = []
        self.paths: list[str] = []
        self.headers: list[dict] = []
        self.client_ports: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0


def make_app(state: FakeState):
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def generate(request: Request, chat: bool):
        body = await request.json()
        state.requests.append(body)
        state.headers.append(dict(request.headers))
        state.paths.append(request.url.path)
        state.client_ports.append(request.client.port)
        if state.fail_every and len(state.requests) % state.fail_every == 0:
            return JSONResponse({"error": "injected failure"}, status_code=500)
        limit = body["max_completion_tokens"] if chat else body["max_tokens"]
        n = limit if body.get("ignore_eos") else min(limit, state.eos_after)
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)

        def choice(i: int) -> dict:
            end = "length" if i == n - 1 else None
            if chat:  # the first chunk also carries the role, as vLLM and llama-server send it
                delta = {"content": f" t{i}"} | ({"role": "assistant"} if i == 0 else {})
                return {"index": 0, "delta": delta, "finish_reason": end}
            return {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": end}

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                await asyncio.sleep(state.first_token_delay)
                for i in range(n):
                    if i:
                        await asyncio.sleep(state.token_delay)
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield f"data: {json.dumps({'object': obj, 'choices': [choice(i)]})}\n\n"
                    if state.bad_json and i == 0:
                        yield "data: {not json\n\n"
                if include_usage and state.send_usage:
                    await asyncio.sleep(state.usage_delay)
                    usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


class ThreadServer:
    def __init__(self, state: FakeState) -> None:
        import uvicorn

        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from backboard.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("bench-tiny")), arch="qwen3_5_text",
                                 preset="tiny")


@pytest.fixture
def fake():
    with ThreadServer(FakeState()) as srv:
        yield srv


def bench(url: str, model_dir: str, *extra: str) -> int:
    from backboard.cli import main

    return main(["bench", "serve", "--base-url", url, "--model", "fake-model", "--tokenizer",
                 model_dir, "--disable-tqdm", *extra])


# ---------------------------------------------------------------- stream parsing


def _reader():
    from backboard.bench.client import StreamReader
    from backboard.bench.metrics import RequestOutput

    out = RequestOutput(prompt_len=7)
    return out, StreamReader(out, st=10.0)


def _chunk(text="x") -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]})


def test_stream_token_chunks_usage_and_done():
    out, r = _reader()
    r.feed("", 10.1)  # blank lines are skipped
    r.feed("   \r\n", 10.1)
    r.feed(_chunk("a") + "\n", 10.5)  # first token chunk: TTFT
    r.feed(b"data: " + json.dumps({"choices": [{"text": ""}]}).encode(), 10.75)  # empty text counts
    r.feed(_chunk("c").removeprefix("data: "), 11.0)  # no prefix: still JSON
    r.feed("data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 3}}), 12.0)
    r.feed("data: [DONE]", 13.0)
    r.finish()
    assert out.success and out.error == ""
    assert out.ttft == pytest.approx(0.5)
    assert out.itl == pytest.approx([0.25, 0.25])
    assert out.latency == pytest.approx(1.0)  # to the last token chunk, not usage / [DONE]
    assert out.output_tokens == 3
    assert out.generated_text == "ac"


def test_stream_without_usage_counts_zero_tokens():
    out, r = _reader()
    r.feed(_chunk(), 10.5)
    r.feed(_chunk(), 10.6)
    r.feed("data: [DONE]", 10.7)
    r.finish()
    assert out.success and out.output_tokens == 0


def test_stream_usage_with_choices_is_a_token_chunk_not_a_count():
    out, r = _reader()
    r.feed("data: " + json.dumps({"choices": [{"text": "a"}], "usage": {"completion_tokens": 9}}),
           10.5)
    r.finish()
    assert out.success and out.output_tokens == 0


def test_stream_without_token_chunk_fails():
    out, r = _reader()
    r.feed("data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 0}}), 10.5)
    r.feed("data: [DONE]", 10.6)
    r.finish()
    assert not out.success and "token chunk" in out.error


def test_stream_parse_error_raises():
    _, r = _reader()
    with pytest.raises(json.JSONDecodeError):
        r.feed("data: {oops", 10.5)


def test_payload_is_inferencex_s():
    from backboard.bench.client import completion_payload
    from backboard.bench.dataset import BenchRequest

    p = completion_payload("m", BenchRequest("hello", 5, 17))
    assert p == {"model": "m", "prompt": "hello", "temperature": 0.0, "best_of": 1,
                 "max_tokens": 17, "logprobs": None, "stream": True,
                 "stream_options": {"include_usage": True}, "ignore_eos": True}


def _chat_chunk(content: str | None = "x", role: bool = False) -> str:
    delta = {"content": content} | ({"role": "assistant"} if role else {})
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]})


def test_chat_stream_reads_deltas_and_ends_at_the_usage_chunk():
    """InferenceX's openai-chat reader: text from delta.content; every chunk, the usage one too,
    moves the end of the request (E2EL), unlike the completions reader."""
    from backboard.bench.client import StreamReader
    from backboard.bench.metrics import RequestOutput

    out = RequestOutput(prompt_len=7)
    r = StreamReader(out, st=10.0, chat=True)
    r.feed(_chat_chunk(None, role=True), 10.5)  # the role chunk is a token chunk: TTFT
    r.feed(_chat_chunk("a"), 10.6)
    r.feed(_chat_chunk("b"), 11.0)
    r.feed("data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 2}}), 11.25)
    r.feed("data: [DONE]", 12.0)
    r.finish()
    assert out.success and out.output_tokens == 2 and out.generated_text == "ab"
    assert out.ttft == pytest.approx(0.5) and out.itl == pytest.approx([0.1, 0.4])
    assert out.latency == pytest.approx(1.25)


def test_chat_payload_is_inferencex_s():
    from backboard.bench.client import BACKENDS, chat_payload
    from backboard.bench.dataset import BenchRequest

    p = chat_payload("m", BenchRequest("hello", 5, 17))
    assert p == {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}]}], "temperature": 0.0, "max_completion_tokens": 17,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    assert BACKENDS["openai-chat"].path == "/v1/chat/completions" and BACKENDS["openai-chat"].chat
    assert BACKENDS["vllm"].path == BACKENDS["openai"].path == "/v1/completions"


# ---------------------------------------------------------------- over HTTP


def _send(url: str, state: FakeState | None = None):
    from backboard.bench.client import completion_payload, make_client, send_request
    from backboard.bench.dataset import BenchRequest

    async def go():
        async with make_client(1) as client:
            return await send_request(client, url + "/v1/completions",
                                      completion_payload("m", BenchRequest("hi", 2, 4)), 2)
    return asyncio.run(go())


def test_non_200_fails_the_request(fake):
    fake.state.fail_every = 1
    out = _send(fake.url)
    assert not out.success and out.error.startswith("HTTP 500") and "injected" in out.error


def test_json_error_in_stream_fails_the_request(fake):
    fake.state.bad_json = True
    out = _send(fake.url)
    assert not out.success and "invalid JSON" in out.error


def test_a_connection_per_request(fake):
    """As InferenceX's client: each request opens its own connection (no keep-alive reuse, which
    raced llama-server's 5 s keep-alive timeout and lost requests)."""
    from backboard.bench.client import completion_payload, make_client, send_request
    from backboard.bench.dataset import BenchRequest

    async def go():
        async with make_client(4) as client:
            for _ in range(3):
                out = await send_request(client, fake.url + "/v1/completions",
                                         completion_payload("m", BenchRequest("hi", 2, 4)), 2)
                assert out.success
    asyncio.run(go())
    assert len(set(fake.state.client_ports)) == 3, fake.state.client_ports


def test_connection_refused_is_recorded():
    out = _send(f"http://127.0.0.1:{free_port()}")
    assert not out.success and "Connect" in out.error


def test_bench_serve_end_to_end(fake, tiny_model, tmp_path, capsys):
    fake.state.first_token_delay = 0.02
    res_file = tmp_path / "r.json"
    rc = bench(fake.url, tiny_model, "--input-len", "32", "--output-len", "16", "--concurrency",
               "3", "--num-prompts", "12", "--api-key", "sekrit", "--result-file", str(res_file))
    assert rc == 0
    r = json.loads(res_file.read_text())
    assert_inferencex_fields(r)
    assert r["completed"] == 12 and r["failed"] == 0 and not r["run_failed"]
    assert r["max_concurrency"] == 3 and r["num_warmups"] == 6
    # 1 test request + 6 warmups (copies of the first request) + 12 timed requests
    reqs = fake.state.requests
    assert len(reqs) == 19
    assert all(q["prompt"] == reqs[0]["prompt"] for q in reqs[:7])
    assert fake.state.max_in_flight == 3  # closed loop: exactly C in flight
    assert all(h.get("authorization") == "Bearer sekrit" for h in fake.state.headers)
    timed = reqs[7:]
    assert sorted(r["output_lens"]) == sorted(q["max_tokens"] for q in timed)
    assert r["total_output_tokens"] == sum(q["max_tokens"] for q in timed)
    assert all(12 <= q["max_tokens"] <= 16 for q in timed)  # [int(16 * 0.8), 16]
    assert r["total_input_tokens"] == sum(r["input_lens"])
    assert r["median_ttft_ms"] >= 20.0  # the server waits 20 ms before the first token
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_serve_chat_backend(fake, tiny_model, tmp_path):
    """--backend openai-chat: every request goes to the chat endpoint as one user message, output
    tokens come from the usage chunk, and the late usage chunk counts in E2EL."""
    fake.state.usage_delay = 0.05
    res_file = tmp_path / "r.json"
    assert bench(fake.url, tiny_model, "--backend", "openai-chat", "--input-len", "16",
                 "--output-len", "8", "--concurrency", "2", "--num-prompts", "6",
                 "--result-file", str(res_file)) == 0
    r = json.loads(res_file.read_text())
    assert r["backend"] == "openai-chat" and r["completed"] == 6 and r["failed"] == 0
    assert set(fake.state.paths) == {"/v1/chat/completions"}
    timed = fake.state.requests[-6:]
    assert all(q["messages"][0]["role"] == "user" and "prompt" not in q for q in timed)
    assert r["total_output_tokens"] == sum(q["max_completion_tokens"] for q in timed)
    assert r["median_e2el_ms"] >= 50.0  # the usage chunk comes 50 ms after the last token


def test_bench_serve_without_usage_counts_no_tokens(fake, tiny_model, tmp_path):
    fake.state.send_usage = False
    res_file = tmp_path / "r.json"
    assert bench(fake.url, tiny_model, "--input-len", "16", "--output-len", "8", "--concurrency",
                 "2", "--num-prompts", "4", "--result-file", str(res_file)) == 0
    r = json.loads(res_file.read_text())
    assert r["completed"] == 4 and r["total_output_tokens"] == 0 and r["mean_tpot_ms"] == 0.0


def test_more_than_5_percent_failed_fails_the_run(fake, tiny_model, tmp_path, capsys):
    fake.state.fail_every = 5  # the test request is #1; #5, #10, #15, #20 of the 20 timed fail
    res_file = tmp_path / "r.json"
    rc = bench(fake.url, tiny_model, "--input-len", "16", "--output-len", "4", "--concurrency",
               "2", "--num-prompts", "20", "--num-warmups", "0", "--result-file", str(res_file))
    assert rc == 1
    r = json.loads(res_file.read_text())
    assert r["run_failed"] and r["failed"] == 4 and r["completed"] == 16
    assert sum(1 for e in r["errors"] if e.startswith("HTTP 500")) == 4
    assert "run failed" in capsys.readouterr().err


def test_5_percent_failed_is_still_a_run(fake, tiny_model, tmp_path):
    fake.state.fail_every = 20  # requests 20 and 40 of 1 + 40: 2 of 40 timed = 5%
    res_file = tmp_path / "r.json"
    rc = bench(fake.url, tiny_model, "--input-len", "16", "--output-len", "4", "--concurrency",
               "4", "--num-prompts", "40", "--num-warmups", "0", "--result-file", str(res_file))
    r = json.loads(res_file.read_text())
    assert r["failed"] == 2 and not r["run_failed"] and rc == 0


def test_unreachable_server_is_a_clear_error(tiny_model, capsys):
    rc = bench(f"http://127.0.0.1:{free_port()}", tiny_model, "--input-len", "8", "--output-len",
               "4", "--concurrency", "1")
    assert rc == 2
    err = capsys.readouterr().err
    assert "error: the test request to" in err and "Connect" in err


@pytest.mark.parametrize("argv, message", [
    (["--base-url", "localhost:8000"], "base URL must look like"),
    (["--concurrency", "0"], "must be >= 1"),
    (["--range-ratio", "1.5"], "must be in [0, 1]"),
    (["--input-len", "ten"], "expected an integer"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    from backboard.cli import main

    base = {"--base-url": "http://127.0.0.1:1", "--input-len": "8", "--output-len": "4",
            "--concurrency": "1", "--model": "m"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", *[x for kv in base.items() for x in kv]])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- as a script


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-delay", type=float, default=0.002)
    a = p.parse_args()
    uvicorn.run(make_app(FakeState(token_delay=a.token_delay)), host="127.0.0.1", port=a.port,
                log_level="warning")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
