"""Run the server: the engine process, uvicorn, and the order things start and stop in.

Start-up: the engine process is spawned and uvicorn binds at once (/health answers 503 while the
model loads, 200 once it is ready); if the model fails to load, the error is printed and the server
exits non-zero. SIGTERM / SIGINT: new requests get 503, the running ones finish, then uvicorn
closes and the engine process is stopped; exit 0. A second signal stops at once."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from dataclasses import dataclass

import uvicorn

from backboard.config import EngineConfig
from backboard.engine.async_llm import AsyncLLM
from backboard.engine.request_stream import EngineDeadError, EngineStartError
from backboard.server.api import ServerState, build_app
from backboard.server.metrics import ServerMetrics

logger = logging.getLogger("backboard.server")

DRAIN_POLL_S = 0.05


@dataclass
class ServeOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    served_names: tuple[str, ...] = ()
    api_key: str | None = None
    stream_interval: int = 1
    log_level: str = "info"
    access_log: bool = False
    drain_timeout_s: float = 600.0
    cpu_threads: int | None = None
    engine_address: str | None = None       # see EngineAddresses.parse (None: ipc in a temp dir)
    disable_frontend: bool = False
    scorecard_dir: str | None = None


class _Server(uvicorn.Server):
    """uvicorn, with a graceful drain on the first SIGTERM / SIGINT (no re-raise afterwards)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining or self._loop is None:
            # a second signal: stop now (uvicorn's own handling, without re-raising the signal)
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        logger.info("received %s: draining (no new requests; %d running)", signal.Signals(sig).name,
                    self.state.engine.num_unfinished)
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while self.state.engine.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        logger.info("drained; shutting down")
        self.should_exit = True


def serve(cfg: EngineConfig, tokenizer, opts: ServeOptions) -> int:
    """Serve until stopped; returns the process exit code."""
    try:
        sock = bind(opts.host, opts.port)
    except OSError as e:
        print(f"error: cannot listen on {opts.host}:{opts.port}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 1
    try:
        return asyncio.run(_serve(cfg, tokenizer, opts, sock))
    finally:
        sock.close()


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts (a busy port fails at once)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


async def _serve(cfg: EngineConfig, tokenizer, opts: ServeOptions, sock: socket.socket) -> int:
    names = list(opts.served_names) or [cfg.model.path]
    metrics = ServerMetrics(names[0], cfg.num_spec_tokens)
    engine = AsyncLLM(cfg, tokenizer, log_level=opts.log_level, on_stats=metrics.update_engine,
                      on_finished=metrics.observe_finished, cpu_threads=opts.cpu_threads,
                      addresses=opts.engine_address)
    state = ServerState(engine, tokenizer, names, cfg.model.path, cfg.scheduler.max_model_len, metrics,
                        api_key=opts.api_key, stream_interval=opts.stream_interval,
                        frontend=not opts.disable_frontend, scorecard_dir=opts.scorecard_dir)
    config = uvicorn.Config(build_app(state), host=opts.host, port=opts.port, log_level=opts.log_level,
                            access_log=opts.access_log, timeout_graceful_shutdown=30,
                            timeout_keep_alive=30, lifespan="off")
    server = _Server(config, state, opts.drain_timeout_s)
    await engine.start()
    served = asyncio.ensure_future(server.serve(sockets=[sock]))
    code = 0
    try:
        ready = asyncio.ensure_future(engine.wait_ready())
        await asyncio.wait({ready, served}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            try:
                line = ready.result()
                logger.info("engine ready (pid %s): %s", engine.pid, line)
                logger.info("serving %s on http://%s:%d", ", ".join(names), opts.host, opts.port)
            except (EngineStartError, EngineDeadError) as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                code = 1
                server.should_exit = True
        else:
            ready.cancel()
        await served
        if not server.started and code == 0:
            code = 1                              # uvicorn could not start (it logged why)
    finally:
        await engine.shutdown()
    return code
