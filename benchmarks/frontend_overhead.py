#!/usr/bin/env python
"""What the HTTP front end and the process hop cost: TTFT seen by a streaming client minus the
engine's own queue + prefill time, at concurrency 1 and 64 (the InferenceX request shape).

    python benchmarks/frontend_overhead.py                       # starts a server on a tiny model
    python benchmarks/frontend_overhead.py --model PATH          # ... on PATH
    python benchmarks/frontend_overhead.py --url http://HOST:PORT --tokenizer PATH   # a running server

Each request asks for the server's timestamps (header `x-backboard-timing: 1`; they come back in
the final usage chunk), all on the same clock (time.time(), one machine):

    client send ─► app (ASGI) ─► sent to engine ─► engine took it ─► first token (engine) ─►
    front end got it ─► first chunk written ─► client got it

engine time = first token (engine) - engine took it   (queueing in the scheduler + prefill)
overhead    = client TTFT - engine time               (HTTP, JSON, tokenization, both pipe hops,
                                                       detokenization, SSE; also the wait for the
                                                       engine's current step to end before it
                                                       reads its input, listed as "pipe in")
"inside the server" leaves out the client and the loopback: ASGI start to first chunk written.
It also reports how busy the engine process was during the 64-stream phase: the time it spent
inside step() (from /metrics) over the phase's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

import httpx
import numpy as np

PHASES = [("HTTP in (client -> app)", "t_send", "arrival"),
          ("parse + validate + tokenize (app -> sent)", "arrival", "sent"),
          ("pipe in (sent -> engine took it)", "sent", "engine_received"),
          ("engine queue + prefill", "engine_received", "engine_first_token"),
          ("pipe out + detok (engine -> front end)", "engine_first_token", "first_output"),
          ("SSE (front end -> chunk written)", "first_output", "first_chunk"),
          ("HTTP out (chunk written -> client)", "first_chunk", "t_first")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, max_num_seqs: int, max_model_len: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "backboard.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len), "--log-level", "warning",
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server did not become healthy")


def engine_counters(url: str) -> tuple[float, float, float, float]:
    """(seconds inside step(), steps, running, kv usage) from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def get(name: str) -> float:
        m = re.search("^" + re.escape(name) + r"(\{[^}]*\})? (\S+)$", text, re.MULTILINE)
        return float(m.group(2)) if m else 0.0

    return (get("backboard:engine_step_time_seconds_total"), get("backboard:engine_steps_total"),
            get("backboard:num_requests_running"), get("backboard:kv_cache_usage_perc"))


def wait_idle(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, _, running, kv = engine_counters(url)
        if running == 0 and kv == 0:
            time.sleep(0.6)               # let the idle stats arrive
            return
        time.sleep(0.1)


async def _http_stream(host: str, port: int, path: str, body: bytes, headers: dict[str, str]):
    """A lean HTTP/1.1 POST (one connection per request, as InferenceX's aiohttp client does):
    yields the response body's chunks as they arrive. Lean so that the client's own CPU time
    (on a shared machine) does not blur the server's figures as much as httpx would."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write((f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n{head}\r\n").encode() + body)
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            chunked |= k.strip().lower() == "transfer-encoding" and "chunked" in v.lower()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read())[:300]!r}")
        if not chunked:
            yield await reader.read()
            return
        while True:
            n = int((await reader.readline()).split(b";")[0], 16)
            if n == 0:
                return
            data = await reader.readexactly(n)
            await reader.readexactly(2)
            yield data
    finally:
        writer.close()


async def one_request(url: str, model: str | None, prompt: str, max_tokens: int, api_key: str | None) -> dict:
    """One InferenceX-shaped streaming request; client timestamps + the server's."""
    payload = {"prompt": prompt, "temperature": 0.0, "best_of": 1, "max_tokens": max_tokens,
               "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
               "ignore_eos": True}
    if model:
        payload["model"] = model
    headers = {"x-backboard-timing": "1"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    u = urlparse(url)
    rec: dict = {"t_send": time.time()}
    buf = b""
    async for data in _http_stream(u.hostname, u.port, "/v1/completions", json.dumps(payload).encode(), headers):
        now = time.time()
        buf += data
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            line = ev.strip().removeprefix(b"data: ")
            if not line or line == b"[DONE]":
                continue
            chunk = json.loads(line)
            if chunk.get("choices"):
                rec.setdefault("t_first", now)
                rec["t_last"] = now
            elif chunk.get("usage"):
                rec["completion_tokens"] = chunk["usage"]["completion_tokens"]
                rec.update(chunk.get("backboard_timing") or {})
    return rec


async def run_phase(url: str, model: str | None, prompts: list[str], concurrency: int, max_tokens: int,
                    api_key: str | None) -> tuple[list[dict], float]:
    """A closed loop of `concurrency` requests in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def limited(p: str) -> dict:
        async with sem:
            return await one_request(url, model, p, max_tokens, api_key)

    t0 = time.time()
    recs = await asyncio.gather(*(limited(p) for p in prompts))
    return recs, time.time() - t0


def make_prompts(tokenizer_path: str | None, n: int, input_len: int, seed: int) -> list[str]:
    """Random-token prompts of about input_len tokens (InferenceX-style), or plain words."""
    rng = np.random.default_rng(seed)
    if tokenizer_path:
        from backboard.engine.tokenizer import Tokenizer

        tok = Tokenizer(tokenizer_path)
        vocab = tok.vocab_size
        return [tok.decode(((int(rng.integers(vocab)) + i + np.arange(input_len)) % vocab).tolist())
                for i in range(n)]
    words = "the engine serves a batch of requests from many clients at once".split()
    return [" ".join(rng.choice(words, input_len)) for _ in range(n)]


def summarize(recs: list[dict]) -> dict[str, tuple[float, float, float]]:
    """component -> (mean, median, p90) in ms."""
    out = {}
    rows = [("client TTFT", "t_send", "t_first")] + PHASES
    for name, a, b in rows:
        vals = [r[b] - r[a] for r in recs if r.get(a) is not None and r.get(b) is not None]
        if vals:
            v = np.array(vals) * 1e3
            out[name] = (float(v.mean()), float(np.median(v)), float(np.percentile(v, 90)))
    def stats(v: list[float]) -> tuple[float, float, float]:
        a = np.array(v) * 1e3
        return float(a.mean()), float(np.median(a)), float(np.percentile(a, 90))

    own = [("t_send", "arrival"), ("arrival", "sent"), ("engine_first_token", "first_output"),
           ("first_output", "first_chunk"), ("first_chunk", "t_first")]
    out["front end's own work (all but pipe in, engine)"] = stats(
        [sum(r[b] - r[a] for a, b in own) for r in recs])
    engine = [r["engine_first_token"] - r["engine_received"] for r in recs]
    out["OVERHEAD seen by the client (TTFT - engine)"] = stats(
        [r["t_first"] - r["t_send"] - e for r, e in zip(recs, engine)])
    out["OVERHEAD inside the server (app -> chunk - engine)"] = stats(
        [r["first_chunk"] - r["arrival"] - e for r, e in zip(recs, engine)])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--model", help="checkpoint folder to serve (default: a tiny qwen3_5 built in a temp dir)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--tokenizer", default=None, help="for the prompts (default: the model folder)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=2, help="requests per concurrency slot")
    ap.add_argument("--min-requests", type=int, default=16, help="at least this many requests per point")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for `backboard serve`")
    args = ap.parse_args()

    proc = None
    model = args.model
    if args.url is None:
        if model is None:
            from backboard.models.tiny import build_tiny_checkpoint

            model = build_tiny_checkpoint(os.path.join(tempfile.mkdtemp(prefix="fe-bench-"), "m"), arch="qwen3_5")
        proc, url = start_server(model, max(args.concurrency), 4 * args.input_len + args.max_tokens + 64,
                                 args.server_arg)
    else:
        url = args.url.rstrip("/")
    try:
        served = args.served_model_name
        tok_path = args.tokenizer or model
        print(f"server {url}; prompts of ~{args.input_len} tokens, {args.max_tokens} output tokens, "
              f"ignore_eos, streaming with include_usage; {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f} at start")
        warm = make_prompts(tok_path, 8, args.input_len, seed=1)
        asyncio.run(run_phase(url, served, warm, 8, args.max_tokens, args.api_key))
        for c in args.concurrency:
            prompts = make_prompts(tok_path, max(c * args.rounds, args.min_requests), args.input_len, seed=c)
            wait_idle(url)
            s0 = engine_counters(url)
            recs, wall = asyncio.run(run_phase(url, served, prompts, c, args.max_tokens, args.api_key))
            wait_idle(url)
            s1 = engine_counters(url)
            bad = [r for r in recs if r.get("completion_tokens") != args.max_tokens]
            busy = (s1[0] - s0[0]) / wall
            print(f"\n== concurrency {c}: {len(recs)} requests in {wall:.2f} s; engine busy inside step() "
                  f"{busy:.0%} of the wall time ({int(s1[1] - s0[1])} steps, "
                  f"{1e3 * (s1[0] - s0[0]) / max(1, s1[1] - s0[1]):.1f} ms/step)"
                  + (f"; {len(bad)} requests with a wrong token count!" if bad else ""))
            print(f"   {'component':50s} {'mean':>9s} {'median':>9s} {'p90':>9s}   (ms)")
            for name, (mean, med, p90) in summarize(recs).items():
                print(f"   {name:50s} {mean:9.2f} {med:9.2f} {p90:9.2f}")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
