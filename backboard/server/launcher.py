"""Run the server: the engine process, uvicorn, and the order things start and stop in.

Start-up: the engine process is spawned and uvicorn binds at once (/health answers 503 while the
model loads, 200 once it is ready); if the model fails to load, the error is printed and the server
exits non-zero.

SIGTERM / SIGINT: new requests get 503, the running ones finish (for at most --drain-timeout),
then uvicorn closes and the engine process is stopped; exit 0. Requests still running at the drain
timeout, or at a second signal, end with an error: a stream gets an error event and [DONE], a
waiting client a 503, never a cut-off body. A third signal stops at once.

The engine's death is loud: in-flight requests fail (500 / an error event), /health answers 503,
`backboard:engine_up` drops to 0, and a moment later the server exits with code 1, so that a
supervisor's restart-on-failure brings it back (a live HTTP port with a dead engine serves nobody).

Connections: uvicorn's httptools protocol with header and send timeouts (server/connections.py);
request bodies and per-request work within the limits of server/limits.py."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from dataclasses import dataclass, field

import uvicorn

from backboard.config import EngineConfig
from backboard.core.heap import freeze_startup_heap
from backboard.engine.async_llm import AsyncLLM
from backboard.engine.cpu_threads import set_frontend_threads
from backboard.engine.dp_client import engine_client
from backboard.engine.request_stream import EngineDeadError, EngineStartError, ServerShuttingDown
from backboard.server.api import ServerState, build_app
from backboard.server.connections import guarded_protocol
from backboard.server.limits import ServerLimits
from backboard.server.metrics import ServerMetrics

logger = logging.getLogger("backboard.server")

DRAIN_POLL_S = 0.05
STOP_FLUSH_S = 3.0          # drain timeout / second signal: time for the error events to go out
ENGINE_DEATH_GRACE_S = 1.0  # engine died: time for in-flight clients to get their error, then exit


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
    engine_address: str | None = None       # see EngineAddresses.parse (None: ipc in a temp dir)
    limits: ServerLimits = field(default_factory=ServerLimits)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    disable_frontend: bool = False
    scorecard_dir: str | None = None


class _Server(uvicorn.Server):
    """uvicorn, with a graceful drain on the first SIGTERM / SIGINT, requests ended with an error at
    the drain timeout or a second signal, and an exit at a third (no re-raise afterwards)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._stopping = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self._loop is None or self._stopping:
            # before serving, or a third signal: stop now (uvicorn's own handling, no re-raise)
            self.force_exit = self.should_exit
            self.should_exit = True
        elif self.state.draining:
            logger.info("received %s again: ending the %d running request(s) now", name,
                        self.state.engine.num_unfinished)
            self._stopping = True
            self._loop.call_soon_threadsafe(self._start_stop, f"the server is shutting down ({name})")
        else:
            logger.info("received %s: draining (no new requests; %d running)", name,
                        self.state.engine.num_unfinished)
            self.state.draining = True
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    def _start_stop(self, why: str) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
        asyncio.ensure_future(self._stop(why))

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while self.state.engine.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.state.engine.num_unfinished:
            self._stopping = True
            await self._stop("the server is shutting down (drain timeout)")
            return
        logger.info("drained; shutting down")
        self.should_exit = True

    async def _stop(self, why: str) -> None:
        """End every running request with an error (an error event and [DONE] for a stream, a 503
        for a waiting client), give the responses a moment to go out, then shut down."""
        self.state.engine.fail_all(ServerShuttingDown(why))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_FLUSH_S
        while self.state.active_requests and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self.config.timeout_graceful_shutdown = STOP_FLUSH_S     # clients still stuck: not for long
        logger.info("%s; shutting down", why)
        self.should_exit = True

    async def exit_when_engine_dies(self, engine: AsyncLLM) -> None:
        """The engine died: in-flight requests already failed; let their errors go out, exit 1."""
        why = await engine.dead
        logger.error("exiting: the engine is gone (%s); restart the server", why)
        await asyncio.sleep(ENGINE_DEATH_GRACE_S)
        self.engine_died = True
        self._stopping = True
        self.config.timeout_graceful_shutdown = STOP_FLUSH_S
        self.should_exit = True


def serve(cfg: EngineConfig, tokenizer, opts: ServeOptions) -> int:
    """Serve until stopped; returns the process exit code."""
    try:
        sock = bind(opts.host, opts.port)
    except OSError as e:
        print(f"error: cannot listen on {opts.host}:{opts.port}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 1
    set_frontend_threads()      # the engine process computes on every core; nothing here competes
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
    if cfg.parallel.data_parallel_size > 1:
        metrics.add_engines(cfg.parallel.data_parallel_size)
    engine = engine_client(cfg, tokenizer, log_level=opts.log_level, on_stats=metrics.update_engine,
                           on_finished=metrics.observe_finished, addresses=opts.engine_address,
                           on_pause=metrics.observe_pause, on_engine_stats=metrics.update_engine_replica)
    state = ServerState(engine, tokenizer, names, cfg.model.path, cfg.scheduler.max_model_len, metrics,
                        api_key=opts.api_key, stream_interval=opts.stream_interval, limits=opts.limits,
                        reasoning_parser=opts.reasoning_parser, tool_call_parser=opts.tool_call_parser,
                        frontend=not opts.disable_frontend, scorecard_dir=opts.scorecard_dir)
    app = build_app(state)
    lim = state.limits
    protocol = guarded_protocol(lim.header_timeout, lim.send_timeout, metrics.observe_timeout)
    config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                            access_log=opts.access_log, timeout_graceful_shutdown=30, http=protocol,
                            timeout_keep_alive=lim.keep_alive_timeout, lifespan="off")
    server = _Server(config, state, opts.drain_timeout_s)
    server.engine_died = False
    await engine.start()
    served = asyncio.ensure_future(server.serve(sockets=[sock]))
    watch: asyncio.Future | None = None
    code = 0
    try:
        ready = asyncio.ensure_future(engine.wait_ready())
        await asyncio.wait({ready, served}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            try:
                line = ready.result()
                logger.info("engine ready (pid %s): %s", engine.pid, line)
                logger.info("serving %s on http://%s:%d", ", ".join(names), opts.host, opts.port)
                metrics.engine_up.labels(names[0]).set(1)
                engine.dead.add_done_callback(lambda _: metrics.engine_up.labels(names[0]).set(0))
                watch = asyncio.ensure_future(server.exit_when_engine_dies(engine))
                freeze_startup_heap()            # modules, the tokenizer, the app (core/heap.py)
            except (EngineStartError, EngineDeadError) as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                code = 1
                server.should_exit = True
        else:
            ready.cancel()
        await served
        if (not server.started or server.engine_died) and code == 0:
            code = 1                              # uvicorn could not start (it logged why), or the engine died
    finally:
        if watch is not None:
            watch.cancel()
        await engine.shutdown()
    return code
