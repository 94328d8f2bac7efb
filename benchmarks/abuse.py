#!/usr/bin/env python
"""Hostile clients against `backboard serve` (issue 14), all in one run, on loopback.

    python benchmarks/abuse.py                          # a tiny model built on first use
    python benchmarks/abuse.py --model PATH --out benchmarks/results/abuse-DATE.md
    python benchmarks/abuse.py --probes stop_list,slowloris --hold 20

Each probe runs while a watcher polls GET /health every 50 ms and a victim client sends a small
(4-token) completion every second; the table reports the probe's outcome, /health latency (median
and worst), the victim's worst latency, and the front-end process's resident memory before, at its
peak, and a few seconds after the probe. The limits under test are the server's defaults, except
where a probe says otherwise. The last probe kills the engine process (the server must exit).

Probes (the issue's list):
    stop_list       a completion with 100,000 stop strings (about 1.4 MB)
    big_response    non-streamed n=64, max_tokens=2000, logprobs=20
    large_response  non-streamed n=8, max_tokens=1000, logprobs=20 (inside the default limits)
    prompt_10mb     three 10 MB prompts at once
    body_100mb      a 100 MB request body
    non_reading     two streaming clients that never read (held --hold seconds, then closed)
    fairness        n=128 with max_tokens up to the context (refused), then the largest allowed
                    n=128 request; a 4-token request behind it
    slowloris       550 idle connections + 50 that send a header byte every 2 s
    small_things    seed=2**63-1 with n=2, "stream": "yes", "n": true, cut-short uploads
    engine_kill     SIGKILL the engine process mid-stream: the client's last event, the exit
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROBES = ["stop_list", "big_response", "large_response", "prompt_10mb", "body_100mb", "non_reading",
          "fairness", "slowloris", "small_things", "engine_kill"]


# ---- the server -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_mb(self) -> float:
        return _rss_mb(self.proc.pid)

    def engine_pid(self) -> int | None:
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
        return None


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def start_server(model: str, max_model_len: int, extra: list[str], log_dir: str) -> Server:
    port = _free_port()
    log_path = Path(log_dir) / "server.log"
    cmd = [sys.executable, "-m", "backboard.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "m", "--max-model-len", str(max_model_len), *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"))
    server = Server(proc, f"http://127.0.0.1:{port}", port, log_path)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}):\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    sys.exit("the server did not become healthy")


# ---- what runs beside each probe --------------------------------------------------------------
@dataclass
class Watch:
    """/health latencies, the victim's latencies and the front end's memory while a probe runs."""

    server: Server
    health_s: list[float] = field(default_factory=list)
    victim_s: list[float] = field(default_factory=list)
    victim_errors: int = 0
    rss_peak: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> "Watch":
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._health, self._victim)]
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)

    def _health(self) -> None:
        with httpx.Client(timeout=300) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    c.get(self.server.url + "/health")
                except httpx.HTTPError:
                    pass
                self.health_s.append(time.perf_counter() - t0)
                self.rss_peak = max(self.rss_peak, self.server.rss_mb())
                time.sleep(0.05)

    def _victim(self) -> None:
        body = {"model": "m", "prompt": "a small request", "max_tokens": 4, "ignore_eos": True}
        with httpx.Client(timeout=300) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = c.post(self.server.url + "/v1/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.victim_s.append(time.perf_counter() - t0)
                self.victim_errors += not ok
                self.stop.wait(1.0)


@dataclass
class Row:
    probe: str
    outcome: str
    health_p50_ms: float
    health_max_ms: float
    victim_max_s: float
    rss_before: float
    rss_peak: float
    rss_after: float


def run_probe(server: Server, name: str, fn, settle_s: float) -> Row:
    before = server.rss_mb()
    w = Watch(server).start()
    t0 = time.perf_counter()
    try:
        outcome = fn(server)
    except Exception as e:  # noqa: BLE001 - a probe's failure is a result
        outcome = f"probe error: {type(e).__name__}: {e}"
    outcome += f" [{time.perf_counter() - t0:.1f} s]"
    w.finish()
    time.sleep(settle_s)
    after = server.rss_mb()
    h = w.health_s or [float("nan")]
    v = w.victim_s or [float("nan")]
    victim = max(v) if not w.victim_errors else float("inf")
    return Row(name, outcome, 1e3 * statistics.median(h), 1e3 * max(h), victim, before,
               max(w.rss_peak, before, after), after)


# ---- the probes -------------------------------------------------------------------------------
def _post(server: Server, body: dict, timeout: float = 600) -> tuple[int, str, int]:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)
    return r.status_code, r.text[:160], len(r.content)


def probe_stop_list(server: Server) -> str:
    stops = [f"never{i:07d}" for i in range(100_000)]
    code, text, _ = _post(server, {"model": "m", "prompt": "hello", "max_tokens": 64, "ignore_eos": True,
                                   "stop": stops})
    return f"HTTP {code}" + (f": {_message(text)}" if code != 200 else "")


def probe_big_response(server: Server) -> str:
    code, text, size = _post(server, {"model": "m", "prompt": "hi", "n": 64, "max_tokens": 2000,
                                      "logprobs": 20, "ignore_eos": True})
    return f"HTTP {code}, {size / 1e6:.1f} MB" + (f": {_message(text)}" if code != 200 else "")


def probe_large_response(server: Server) -> str:
    code, text, size = _post(server, {"model": "m", "prompt": "hi", "n": 8, "max_tokens": 1000,
                                      "logprobs": 20, "ignore_eos": True})
    return f"HTTP {code}, {size / 1e6:.1f} MB" + (f": {_message(text)}" if code != 200 else "")


def probe_prompt_10mb(server: Server) -> str:
    prompt = "word " * 2_000_000
    out: list[str] = []

    def one() -> None:
        code, text, _ = _post(server, {"model": "m", "prompt": prompt, "max_tokens": 4})
        out.append(f"{code}")

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return "HTTP " + ", ".join(sorted(out))


def probe_body_100mb(server: Server) -> str:
    """Send a 100 MB JSON body; how much did the server take before it answered?"""
    total, sent = 100 * 2 ** 20, 0
    head_bytes = b'{"prompt": "'
    with socket.create_connection(("127.0.0.1", server.port), timeout=300) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % total + head_bytes)
        sent, chunk = len(head_bytes), b"x" * 2 ** 20
        try:
            while sent < total - 2:
                piece = chunk[:min(len(chunk), total - 2 - sent)]
                s.sendall(piece)
                sent += len(piece)
            s.sendall(b'"}')
        except OSError:
            pass
        try:
            head = s.recv(200).split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError as e:
            head = f"no answer ({type(e).__name__})"
    return f"{head or 'connection closed'} after {sent / 2 ** 20:.0f} MB sent"


def _raw_stream_request(port: int, body: dict) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def probe_non_reading(server: Server, hold_s: float) -> str:
    body = {"model": "m", "prompt": "stream to nobody", "max_tokens": 3500, "ignore_eos": True,
            "stream": True, "logprobs": 5}
    socks = [_raw_stream_request(server.port, body) for _ in range(2)]
    time.sleep(hold_s)
    running = _metric(server, "backboard:num_requests_running")
    for s in socks:
        s.close()
    return f"held {hold_s:.0f} s; engine running at the end: {running:.0f}"


def probe_fairness(server: Server, max_model_len: int) -> str:
    """The issue's n=128 x (context) request, then the largest one the default limits allow
    (n=128 x max_tokens with n x max_tokens = 8 x context); a 4-token request behind the latter."""
    code, text, _ = _post(server, {"model": "m", "prompt": "fill it", "n": 128, "ignore_eos": True,
                                   "max_tokens": max_model_len - 8}, timeout=60)
    issue = f"n=128 x {max_model_len - 8}: HTTP {code}" + (f" ({_message(text)[:60]})" if code != 200 else "")
    allowed = 8 * max_model_len // 128
    result: dict = {}

    def big() -> None:
        try:
            r = httpx.post(server.url + "/v1/completions", timeout=600,
                           json={"model": "m", "prompt": "fill it", "n": 128, "ignore_eos": True,
                                 "max_tokens": allowed})
            result["big"] = f"HTTP {r.status_code} in {time.perf_counter() - t_big:.1f} s"
        except httpx.HTTPError as e:
            result["big"] = f"client gave up ({type(e).__name__})"

    t_big = time.perf_counter()
    t = threading.Thread(target=big)
    t.start()
    time.sleep(3.0)
    t0 = time.perf_counter()
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "me too", "max_tokens": 4, "ignore_eos": True})
        small = f"small request behind it: HTTP {r.status_code} in {time.perf_counter() - t0:.2f} s"
    except httpx.HTTPError:
        small = f"small request behind it: no answer in {time.perf_counter() - t0:.0f} s"
    t.join()
    return f"{issue}; n=128 x {allowed}: {result.get('big')}; {small}"


def probe_slowloris(server: Server, hold_s: float) -> str:
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(550)]
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(50)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    t_end = time.monotonic() + hold_s
    while time.monotonic() < t_end:
        for s in slow:
            try:
                s.sendall(b"X")
            except OSError:
                pass
        time.sleep(2.0)
    closed_idle, closed_slow = _count_closed(idle), _count_closed(slow)
    for s in idle + slow:
        s.close()
    return f"after {hold_s:.0f} s the server had closed {closed_idle}/550 idle, {closed_slow}/50 slow"


def _count_closed(socks: list[socket.socket]) -> int:
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            n += s.recv(4096) == b""
        except BlockingIOError:
            pass
        except OSError:
            n += 1
    return n


def probe_small_things(server: Server) -> str:
    out = []
    for name, body in [("seed=2**63-1,n=2", {"prompt": "x", "n": 2, "seed": 2 ** 63 - 1, "max_tokens": 2}),
                       ('stream="yes"', {"prompt": "x", "stream": "yes", "max_tokens": 2}),
                       ("n=true", {"prompt": "x", "n": True, "max_tokens": 2})]:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        out.append(f"{name}: {r.status_code}")
    lines_before = server.log().count("\n")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n" + b'{"prompt": "' + b"y" * 1000)
            time.sleep(0.3)
    time.sleep(1.0)
    added = server.log().splitlines()[lines_before:]
    errors = sum(" ERROR " in x or "Traceback" in x for x in added)
    out.append(f"3 cut-short uploads: {len(added)} log lines, {errors} ERROR/traceback")
    return "; ".join(out)


def probe_engine_kill(server: Server) -> str:
    events: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                              json={"model": "m", "prompt": "die", "max_tokens": 3000, "ignore_eos": True,
                                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.HTTPError as e:
            events.append(f"<{type(e).__name__}>")

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(2.0)
    pid = server.engine_pid()
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    up = None
    try:
        up = _metric(server, "backboard:engine_up")
    except (httpx.HTTPError, StopIteration, ValueError):
        pass
    try:
        code = server.proc.wait(30)
        exit_ = f"server exited {code} after {time.monotonic() - t_kill:.1f} s"
    except subprocess.TimeoutExpired:
        exit_ = "server still running 30 s later"
    last = events[-2:] if events else ["nothing"]
    return f"stream ended with {[e[:80] for e in last]}; engine_up metric: {up}; {exit_}"


# ---- helpers ----------------------------------------------------------------------------------
def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"][:100]
    except (ValueError, KeyError, TypeError):
        return text[:100]


def _metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith(name + "{") or x.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def table(rows: list[Row]) -> str:
    head = ("| probe | outcome | /health p50 ms | /health max ms | victim max s | RSS before MB | "
            "RSS peak MB | RSS after MB |\n|---|---|---:|---:|---:|---:|---:|---:|")
    lines = [f"| {r.probe} | {r.outcome} | {r.health_p50_ms:.1f} | {r.health_max_ms:.0f} | {r.victim_max_s:.2f} | "
             f"{r.rss_before:.0f} | {r.rss_peak:.0f} | {r.rss_after:.0f} |" for r in rows]
    return "\n".join([head, *lines])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: a tiny model built once)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--probes", default=",".join(PROBES))
    ap.add_argument("--hold", type=float, default=60.0, help="seconds the non-reading / slow clients hold on")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after a probe before memory is read")
    ap.add_argument("--server-args", default="", help="extra `backboard serve` flags (one string)")
    ap.add_argument("--out", default=None, help="also write the report (markdown) here")
    args = ap.parse_args()
    model = args.model or _tiny_model()
    probes = [p for p in args.probes.split(",") if p]
    unknown = set(probes) - set(PROBES)
    if unknown:
        sys.exit(f"unknown probes {sorted(unknown)}; known: {PROBES}")
    fns = {"stop_list": probe_stop_list, "big_response": probe_big_response,
           "large_response": probe_large_response, "prompt_10mb": probe_prompt_10mb,
           "body_100mb": probe_body_100mb, "small_things": probe_small_things, "engine_kill": probe_engine_kill,
           "non_reading": lambda s: probe_non_reading(s, args.hold),
           "fairness": lambda s: probe_fairness(s, args.max_model_len),
           "slowloris": lambda s: probe_slowloris(s, args.hold)}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(model, args.max_model_len, args.server_args.split(), tmp)
        idle = server.rss_mb()
        rows = []
        try:
            for name in probes:
                rows.append(run_probe(server, name, fns[name], args.settle))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
        finally:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
                try:
                    server.proc.wait(60)
                except subprocess.TimeoutExpired:
                    server.proc.kill()
    report = (f"# abuse.py: {time.strftime('%Y-%m-%d %H:%M')}\n\n"
              f"model {model}, --max-model-len {args.max_model_len}, hold {args.hold:.0f} s; "
              f"{os.cpu_count()} CPUs, load average {load_before[0]:.1f} before / {os.getloadavg()[0]:.1f} after; "
              f"front end idle RSS {idle:.0f} MB\n\n" + table(rows) + "\n")
    print("\n" + report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


def _tiny_model() -> str:
    from backboard.models.tiny import build_tiny_checkpoint

    path = os.path.join(tempfile.gettempdir(), "backboard-abuse-tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tiny_checkpoint(path)
    return path


if __name__ == "__main__":
    sys.exit(main())
