"""Servers for the end-to-end tests: `backboard serve` as a subprocess on a free loopback port,
against the tiny hybrid checkpoint. One shared server (session scope) serves most tests; the tests
that stop or break a server start their own."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 240
API_KEY = "test-key"
SERVED_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    proc: subprocess.Popen
    url: str
    log_path: Path
    model: str
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        """The spawned engine process (not multiprocessing's resource tracker)."""
        for pid in _children(self.proc.pid):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmd:
                return pid
        raise AssertionError("no engine process found")

    def metrics(self) -> dict[str, float]:
        """`name{labels}` (model_name dropped) -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "").replace(",}", "}")
            out[key] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def start_server(model: str, log_dir: Path, *args: str, api_key: str | None = None,
                 wait: bool = True, env: dict[str, str] | None = None) -> ServerProc:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "backboard.cli", "serve", model, "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", SERVED_NAME, "--log-level", "info", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProc(proc, f"http://127.0.0.1:{port}", log_path, model, api_key)
    if wait:
        wait_healthy(server)
    return server


def wait_healthy(server: ServerProc, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"backboard serve exited with {server.proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise RuntimeError(f"backboard serve did not become healthy:\n{server.log()[-3000:]}")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def server_model(tiny_models) -> str:
    return tiny_models("qwen3_5")


@pytest.fixture(scope="session")
def api_server(server_model, tmp_path_factory):
    """The shared server: 64 sequences, stream interval 1, an API key."""
    server = start_server(server_model, tmp_path_factory.mktemp("api-server"), "--max-num-seqs", "64",
                          "--max-model-len", "512", api_key=API_KEY)
    yield server
    rc = server.stop()
    assert rc == 0, server.log()[-3000:]


@pytest.fixture(scope="session")
def smollm2_cache(request) -> tuple[str, str]:
    """(cache dir, GGUF path) of the real SmolLM2-135M-Instruct, fetched once into pytest's cache."""
    from backboard.models.smollm2 import fetch_smollm2

    cache = str(request.config.cache.mkdir("backboard-smollm2"))
    return cache, fetch_smollm2(cache)


SMOLLM2_ARGS = ("--max-model-len", "1024", "--dtype", "bfloat16", "--tool-call-parser", "hermes")


@pytest.fixture(scope="session")
def smollm2_servers(smollm2_cache, tmp_path_factory):
    """Two servers on the real SmolLM2 (hermes tool calls), started once and side by side:
    speculation off, and n-gram speculation (k = 3)."""
    cache, gguf = smollm2_cache
    env = {"BACKBOARD_CACHE": cache}             # the conversion is cached with the file
    d = tmp_path_factory.mktemp("smollm2")
    off = start_server(gguf, d, *SMOLLM2_ARGS, env=env, wait=False)
    _wait_for_log(off, "serving ")            # converted (once): the second server reuses it
    ngram = start_server(gguf, d, *SMOLLM2_ARGS, "--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 3}', env=env, wait=False)
    for s in (off, ngram):
        wait_healthy(s)
    yield {"off": off, "ngram": ngram}
    for s in (off, ngram):
        assert s.stop() == 0, s.log()[-3000:]


def _wait_for_log(server: ServerProc, text: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log():
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise RuntimeError(f"backboard serve never logged {text!r}:\n{server.log()[-3000:]}")
        time.sleep(0.25)


@pytest.fixture
def server_factory(server_model, tmp_path):
    """Short-lived servers for tests that stop or break them; always cleaned up."""
    started: list[ServerProc] = []

    def make(*args: str, wait: bool = True, model: str | None = None) -> ServerProc:
        s = start_server(model or server_model, tmp_path, *args, wait=wait)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop(signal.SIGKILL, timeout=10)


def pytest_terminal_summary(terminalreporter) -> None:
    from tests.e2e.browser import ARTIFACTS, WRITTEN

    if WRITTEN:
        terminalreporter.write_line(f"browser screenshots ({len(WRITTEN)}): {ARTIFACTS}")
