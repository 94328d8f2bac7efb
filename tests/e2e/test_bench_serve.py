"""`backboard bench serve` against the real `backboard serve` on a tiny checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.unit.test_bench_client import assert_inferencex_fields

STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from backboard.models.tiny import build_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("bench-e2e")
    model = build_tiny_checkpoint(str(tmp / "model"), arch="qwen3_5_text", preset="tiny")
    port = _free_port()
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "backboard.cli", "serve", model, "--host", "127.0.0.1", "--port",
         str(port), "--max-num-seqs", "4"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"backboard serve exited with {proc.returncode}:\n"
                                   + (tmp / "server.log").read_text(errors="replace")[-3000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("backboard serve did not answer /health in time:\n"
                                   + (tmp / "server.log").read_text(errors="replace")[-3000:])
            time.sleep(0.5)
        yield url, model, tmp
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:  # the engine process, should it outlive the front end
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        log.close()


@pytest.mark.parametrize("backend", ["vllm", "openai-chat"])
def test_bench_serve_against_backboard(server, backend):
    """Both InferenceX backends count every token the server generates (chat: the prompt goes
    through the chat template; the counts are still the client's own)."""
    from backboard.cli import main

    url, model, tmp = server
    models = httpx.get(url + "/v1/models", timeout=10).json()
    served = models["data"][0]["id"]
    result_file = os.path.join(tmp, f"result-{backend}.json")
    rc = main(["bench", "serve", "--base-url", url, "--model", served, "--tokenizer", model,
               "--backend", backend, "--input-len", "32", "--output-len", "16",
               "--concurrency", "4", "--num-prompts", "8", "--num-warmups", "2",
               "--result-file", result_file, "--disable-tqdm"])
    assert rc == 0
    with open(result_file) as f:
        r = json.load(f)
    assert_inferencex_fields(r)
    assert r["failed"] == 0 and r["completed"] == 8 and not r["run_failed"]
    # ignore_eos: every request generates exactly its max_tokens, and usage reports them
    from backboard.bench.dataset import load_tokenizer, sample_random_requests

    reqs = sample_random_requests(load_tokenizer(model), 32, 16, 8, 0.8, seed=0)
    assert r["total_output_tokens"] == sum(q.output_len for q in reqs)
    assert r["total_input_tokens"] == sum(q.prompt_len for q in reqs)
    assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0 and r["output_throughput"] > 0
