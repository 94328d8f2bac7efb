"""The process boundary: the engine core loop in its own process, and the front end's client of it.

    front end (HTTP process, one asyncio loop)          engine process (spawned)
    AsyncLLM.add_request                                EngineCoreProc.run
      InputProcessor, ParentRequest                     ┌ idle: block on the input pipe
      queued; one write per loop turn ──[adds/aborts]──► drain input (add / abort / stop)
                                                        │ busy: step() -> outputs of the step
    RequestStream queues ◄─ OutputProcessor ◄──[one StepMessage per step, + stats]──┘
      (per request)         (detokenize, stop strings)

Both pipes carry pickled messages in length-prefixed frames. The engine process owns EngineCore
and nothing else: no JSON, no tokenization, no client sockets. It busy-steps while it has work and
blocks on its input pipe when idle. The front end never blocks on the engine: its ends of the pipes
are asyncio pipe transports (writes are buffered, reads arrive as callbacks on the loop), so there
is no thread and no lock between the HTTP handlers and the engine. A slow client only lets its own
queue grow.

If the engine process dies (its pipe closes, or its process sentinel fires), every in-flight
request fails with EngineDeadError and new ones are refused; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import pickle
import select
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

from backboard.config import EngineConfig
from backboard.core.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
from backboard.request import EngineCoreRequest
from backboard.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
_PICKLE = pickle.HIGHEST_PROTOCOL


# =============================================================================================
# Messages across the boundary
# =============================================================================================

@dataclass
class EngineStats:
    """Engine-side counters, sent with step outputs (at most every STATS_INTERVAL_S while busy,
    and whenever the engine goes idle)."""

    scheduler: SchedulerStats
    num_steps: int = 0
    step_time_s: float = 0.0          # cumulative wall time spent inside EngineCore.step()
    uptime_s: float = 0.0             # since the loop started
    time: float = 0.0                 # time.time() when taken
    num_generation_tokens: int = 0    # cumulative tokens sampled
    phase_time_s: dict[str, float] = field(default_factory=dict)  # cumulative, EngineCore.phase_times()


@dataclass
class StepMessage:
    """Everything one engine-loop iteration has for the front end."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    received: dict[str, float] = field(default_factory=dict)     # child id -> time taken off the pipe
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (child id, why add_request failed)
    stats: EngineStats | None = None


# front end -> engine: a pickled list of (kind, payload)
ADD, ABORT, STOP, SHUTDOWN = "add", "abort", "stop", "shutdown"
# engine -> front end: (kind, payload)
READY, START_ERROR, FATAL, STEP = "ready", "start_error", "fatal", "step"


_HEADER = 8                              # little-endian payload length


def frame(msg: Any) -> bytes:
    payload = pickle.dumps(msg, _PICKLE)
    return len(payload).to_bytes(_HEADER, "little") + payload


class FrameReader:
    """Bytes in, whole messages out (for a reader that gets arbitrary chunks of the stream)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out, buf, pos = [], self._buf, 0
        while len(buf) - pos >= _HEADER:
            n = int.from_bytes(buf[pos:pos + _HEADER], "little")
            if len(buf) - pos - _HEADER < n:
                break
            out.append(pickle.loads(buf[pos + _HEADER:pos + _HEADER + n]))
            pos += _HEADER + n
        if pos:
            del buf[:pos]
        return out


class BlockingPipe:
    """The engine process's ends of the two pipes: blocking framed reads and writes."""

    def __init__(self, inp: Connection, out: Connection) -> None:
        self._inp, self._out = inp, out            # kept open for their file descriptors
        self.rfd, self.wfd = inp.fileno(), out.fileno()

    def send(self, msg: Any) -> None:
        view = memoryview(frame(msg))
        while view:
            view = view[os.write(self.wfd, view):]

    def poll(self) -> bool:
        return bool(select.select([self.rfd], [], [], 0)[0])

    def recv(self) -> Any:
        """Blocks for one message; EOFError when the front end is gone."""
        n = int.from_bytes(self._read(_HEADER), "little")
        return pickle.loads(self._read(n))

    def _read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            b = os.read(self.rfd, min(left, 1 << 20))
            if not b:
                raise EOFError
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)


# =============================================================================================
# The engine process
# =============================================================================================

def run_engine_core(cfg: EngineConfig, inp: Connection, out: Connection, log_level: str = "INFO",
                    cpu_threads: int | None = None) -> None:
    """Entry point of the engine process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the front end decides when to stop
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s [engine] %(levelname)s %(message)s")
    pipe = BlockingPipe(inp, out)
    try:
        _set_cpu_threads(cfg, cpu_threads)
        from backboard.engine.engine_core import EngineCore

        core = EngineCore(cfg)
    except Exception as e:  # noqa: BLE001 - reported to the front end, which prints it
        logger.debug("engine start-up failed", exc_info=True)
        pipe.send((START_ERROR, (type(e).__name__, str(e))))
        return
    try:
        pipe.send((READY, (core.describe(), core.info())))
        EngineCoreProc(core, pipe).run()
    except (EOFError, BrokenPipeError):
        pass                                          # the front end went away
    except Exception as e:  # noqa: BLE001
        logger.error("engine loop failed:\n%s", traceback.format_exc())
        try:
            pipe.send((FATAL, f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        os._exit(1)


def default_cpu_threads() -> int:
    """All cores but one: the front end process needs one, and torch's spinning OpenMP threads
    stall badly when a core they count on is taken."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _set_cpu_threads(cfg: EngineConfig, n: int | None) -> None:
    if not cfg.device.startswith("cpu"):
        return
    if n is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return                                    # the user chose
        n = default_cpu_threads()
    import torch

    torch.set_num_threads(n)
    logger.info("engine process: %d CPU thread(s)", n)


class EngineCoreProc:
    """The loop of the engine process: drain input, step while there is work, send one message per
    step; block on the input pipe while idle."""

    def __init__(self, core, pipe: BlockingPipe) -> None:
        self.core, self.pipe = core, pipe
        self.start = time.time()
        self.step_time_s = 0.0
        self.pending = StepMessage()
        self.last_stats: tuple[SchedulerStats, int] | None = None
        self.last_stats_time = 0.0

    def run(self) -> None:
        while True:
            if not self.core.has_unfinished_requests():
                if not self._handle(self.pipe.recv()):  # idle: block until the front end speaks
                    return
            while self.pipe.poll():
                if not self._handle(self.pipe.recv()):
                    return
            if self.core.has_unfinished_requests():
                t0 = time.perf_counter()
                outs = self.core.step()
                self.step_time_s += time.perf_counter() - t0
                self.pending.outputs.extend(outs)
            self._flush()

    # ---- input ---------------------------------------------------------------------------
    def _handle(self, msgs: list[tuple[str, Any]]) -> bool:
        """Apply a batch of front-end messages; False on shutdown."""
        for kind, payload in msgs:
            if kind == ADD:
                self._add(payload)
            elif kind == ABORT:
                self.core.abort_requests(payload)     # the front end already forgot them
            elif kind == STOP:
                self.core.stop_requests(payload)
            elif kind == SHUTDOWN:
                return False
        return True

    def _add(self, reqs: list[EngineCoreRequest]) -> None:
        now = time.time()
        for r in reqs:
            try:
                self.core.add_request(r)
                self.pending.received[r.request_id] = now
            except ValueError as e:
                self.pending.rejected.append((r.request_id, str(e)))

    # ---- output --------------------------------------------------------------------------
    def _flush(self) -> None:
        msg = self.pending
        stats = self._stats_if_due()
        if stats is not None:
            msg.stats = stats
        if msg.outputs or msg.received or msg.rejected or msg.stats is not None:
            self.pipe.send((STEP, msg))
            self.pending = StepMessage()

    def _stats_if_due(self) -> EngineStats | None:
        """Stats on change, at most every STATS_INTERVAL_S while busy; always when going idle."""
        now = time.time()
        idle = not self.core.has_unfinished_requests()
        if not idle and now - self.last_stats_time < STATS_INTERVAL_S:
            return None
        s = self.core.stats()
        key = (s, self.core.num_steps)
        if key == self.last_stats:
            return None
        self.last_stats, self.last_stats_time = key, now
        return EngineStats(s, self.core.num_steps, self.step_time_s, now - self.start, now,
                           self.core.num_tokens_generated, self.core.phase_times())


# =============================================================================================
# The front end's side
# =============================================================================================

class EngineDeadError(RuntimeError):
    """The engine process is gone; in-flight requests fail with this."""


class EngineStartError(RuntimeError):
    """The engine process could not load the model (the message says why)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RequestRejected(ValueError):
    """The engine core refused the request (e.g. it can never fit in the KV cache)."""


@dataclass
class ChildDelta:
    """What one step added to one completion (child) of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestTimings:
    """Timestamps (time.time()) along the path of one request."""

    arrival: float                        # the request reached the app (ASGI start, before its body)
    sent: float = 0.0                     # queued for the engine (written at the end of the loop turn)
    engine_received: float | None = None  # the engine process took it off the pipe
    first_scheduled: float | None = None  # engine clock
    engine_first_token: float | None = None  # engine clock: first token sampled
    first_output: float | None = None     # the front end processed the first token
    finished: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return dict(self.__dict__)


class RequestStream:
    """One request's deltas, queued for its HTTP handler. `get()` returns every delta pending
    (a slow reader gets several at once; nothing is merged or lost)."""

    def __init__(self, request_id: str, parent, timings: RequestTimings) -> None:
        self.request_id, self.parent, self.timings = request_id, parent, timings
        self.finished = False
        self.aborted = False
        self._pending: list[ChildDelta] = []
        self._event = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.parent.prompt_ids)

    def _put(self, deltas: list[ChildDelta], finished: bool) -> None:
        self._pending.extend(deltas)
        self.finished = self.finished or finished
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    async def get(self) -> list[ChildDelta]:
        """Wait for deltas; [] once the request is finished and everything was taken."""
        while not self._pending and self._error is None and not self.finished:
            self._event.clear()
            await self._event.wait()
        if self._pending:
            out, self._pending = self._pending, []
            return out
        if self._error is not None:
            raise self._error
        return []

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        while True:
            deltas = await self.get()
            if not deltas:
                return
            yield deltas


class _ReaderProtocol(asyncio.Protocol):
    """The front end's end of the engine's output pipe: frames -> messages, on the loop."""

    def __init__(self, on_message: Callable[[Any], None], on_closed: Callable[[], None]) -> None:
        self.reader, self.on_message, self.on_closed = FrameReader(), on_message, on_closed

    def data_received(self, data: bytes) -> None:
        for msg in self.reader.feed(data):
            self.on_message(msg)

    def eof_received(self) -> None:
        self.on_closed()

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_closed()


class _WriterProtocol(asyncio.Protocol):
    """The front end's end of the engine's input pipe (asyncio buffers what the pipe won't take)."""

    def connection_lost(self, exc: Exception | None) -> None:
        pass                                      # the engine went away: the reader reports it


class AsyncLLM:
    """The front end's engine client: starts the engine process, sends requests and aborts, and
    routes step outputs to per-request streams (all on the asyncio loop it was started on)."""

    def __init__(self, cfg: EngineConfig, tokenizer, log_level: str = "info",
                 on_stats: Callable[[EngineStats], None] | None = None,
                 on_finished: Callable[[RequestStream], None] | None = None,
                 cpu_threads: int | None = None) -> None:
        from backboard.engine.output_processor import InputProcessor, OutputProcessor

        self.cfg, self.tokenizer, self.log_level = cfg, tokenizer, log_level
        self.cpu_threads = cpu_threads
        mc = cfg.model
        eos = tuple(dict.fromkeys(mc.eos_token_ids + tuple(tokenizer.eos_token_ids)))
        self.inputs = InputProcessor(tokenizer, cfg.scheduler.max_model_len, mc.vocab_size, eos)
        self.outputs = OutputProcessor(tokenizer)
        self.on_stats, self.on_finished = on_stats, on_finished
        self.streams: dict[str, RequestStream] = {}
        self.stats: EngineStats | None = None
        self.state = "new"               # new -> starting -> ready -> (dead | stopped)
        self.error: str | None = None
        self.description = ""
        self.info: dict[str, Any] = {}   # the engine's configuration and build (engine_info.py)
        self.detokenize_time_s = 0.0     # cumulative: OutputProcessor.process on this loop
        self._ready: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: mp.process.BaseProcess | None = None
        self._out_transport: asyncio.WriteTransport | None = None
        self._in_transport: asyncio.ReadTransport | None = None
        self._outbox: list[tuple[str, Any]] = []      # sent together at the end of this loop turn

    # ---- life cycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine process and connect its pipes to this event loop."""
        self._loop = loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        ctx = mp.get_context("spawn")
        in_r, in_w = ctx.Pipe(duplex=False)       # front end -> engine
        out_r, out_w = ctx.Pipe(duplex=False)     # engine -> front end
        self._proc = ctx.Process(target=run_engine_core, name="backboard-engine", daemon=True,
                                 args=(self.cfg, in_r, out_w, self.log_level, self.cpu_threads))
        self._proc.start()
        in_r.close()                              # only the child holds these ends: EOF works
        out_w.close()
        self.state = "starting"
        wfile = os.fdopen(os.dup(in_w.fileno()), "wb", buffering=0)
        rfile = os.fdopen(os.dup(out_r.fileno()), "rb", buffering=0)
        in_w.close()
        out_r.close()
        self._out_transport, _ = await loop.connect_write_pipe(lambda: _WriterProtocol(), wfile)
        self._in_transport, _ = await loop.connect_read_pipe(
            lambda: _ReaderProtocol(self._on_message, self._on_pipe_closed), rfile)
        loop.add_reader(self._proc.sentinel, self._on_sentinel)

    async def wait_ready(self) -> str:
        """The engine's start-up line; raises EngineStartError or EngineDeadError."""
        assert self._ready is not None, "start() first"
        return await asyncio.shield(self._ready)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (abandoning whatever it still holds)."""
        if self._proc is None or self.state == "stopped":
            return
        was_dead = self.state == "dead"
        self.state = "stopped"
        for s in list(self.streams.values()):
            s._fail(EngineDeadError("the server is shutting down"))
        self.streams.clear()
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._proc.sentinel)
        if not was_dead:
            self._send(SHUTDOWN, None)
            self._flush()
        self._out_transport.close()
        proc = self._proc
        await loop.run_in_executor(None, proc.join, timeout)
        if proc.is_alive():
            proc.terminate()
            await asyncio.get_running_loop().run_in_executor(None, proc.join, 5.0)
        if proc.is_alive():
            proc.kill()
        self._in_transport.close()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                    prompt_text: str | None = None, arrival_time: float | None = None) -> RequestStream:
        """Validate (InputError), register and send a request; returns its stream."""
        from backboard.engine.output_processor import ParentRequest

        self._check_alive()
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = arrival_time if arrival_time is not None else time.time()
        _, ecr = self.inputs.make_request(prompt_ids, params, request_id=request_id, arrival_time=arrival)
        parent = ParentRequest(request_id, prompt_text, ecr.prompt_token_ids, params, self.tokenizer, arrival)
        stream = RequestStream(request_id, parent, RequestTimings(arrival))
        reqs = []
        for i, cid in enumerate(self.outputs.add(parent)):
            reqs.append(EngineCoreRequest(cid, list(ecr.prompt_token_ids), parent.child_params(i),
                                          ecr.eos_token_ids, ecr.arrival_time, ecr.priority))
        self.streams[request_id] = stream
        stream.timings.sent = time.time()
        self._send(ADD, reqs)
        return stream

    def abort(self, request_id: str) -> None:
        """Forget a request and free what it holds in the engine (client gone, shutdown)."""
        stream = self.streams.pop(request_id, None)
        child_ids = self.outputs.abort(request_id)
        if child_ids and self.state == "ready":
            self._send(ABORT, child_ids)
        if stream is not None and not stream.finished:
            stream.aborted = True
            stream.timings.finished = time.time()
            for c in stream.parent.children:
                if c.out.finish_reason is None:
                    c.out.finish_reason = "abort"
            if self.on_finished is not None:
                self.on_finished(stream)

    def _check_alive(self) -> None:
        if self.state == "ready":
            return
        if self.state in ("new", "starting"):
            raise EngineDeadError("the model is still loading")
        raise EngineDeadError(self.error or "the engine is not running")

    # ---- the pipes ---------------------------------------------------------------------------
    def _send(self, kind: str, payload: Any) -> None:
        """Queue a message; everything queued in one loop turn goes out in one write."""
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append((kind, payload))

    def _flush(self) -> None:
        if self._outbox and not self._out_transport.is_closing():
            self._out_transport.write(frame(self._outbox))
        self._outbox = []

    def _on_pipe_closed(self) -> None:
        """The engine's output pipe closed (after everything it wrote was read): it is gone."""
        if self.state != "stopped":
            self._proc.join(1.0)
            self._on_exit(self._proc.exitcode)

    def _on_sentinel(self) -> None:
        """The process ended; normally its pipe's EOF reports it (after its last messages), this
        is the backstop should something else hold the pipe open."""
        self._loop.remove_reader(self._proc.sentinel)
        self._loop.call_later(1.0, lambda: self._on_exit(self._proc.exitcode))

    # ---- on the event loop ---------------------------------------------------------------
    def _on_message(self, msg: tuple[str, Any]) -> None:
        try:
            self._handle_message(msg)
        except Exception:  # noqa: BLE001 - a bug here must not take the pipe (and every request) down
            logger.exception("failed to process an engine message")

    def _handle_message(self, msg: tuple[str, Any]) -> None:
        kind, payload = msg
        if kind == STEP:
            self._on_step(payload)
        elif kind == READY:
            self.state, (self.description, self.info) = "ready", payload
            if not self._ready.done():
                self._ready.set_result(self.description)
        elif kind == START_ERROR:
            self.state, self.error = "dead", payload[1]
            if not self._ready.done():
                self._ready.set_exception(EngineStartError(*payload))
        elif kind == FATAL:
            self._die(f"the engine failed: {payload}")

    def _on_exit(self, exitcode: int | None) -> None:
        if self.state == "stopped":
            return
        code = "" if exitcode is None else f" (exit code {exitcode})"
        self._die(f"the engine process exited unexpectedly{code}")

    def _die(self, why: str) -> None:
        if self.state in ("dead", "stopped"):
            return
        logger.error(why)
        self.state, self.error = "dead", why
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineDeadError(why))
        for s in self.streams.values():
            s._fail(EngineDeadError(why))
        self.streams.clear()

    def _on_step(self, m: StepMessage) -> None:
        now = time.time()
        for cid, t in m.received.items():
            s = self._stream_of(cid)
            if s is not None and s.timings.engine_received is None:
                s.timings.engine_received = t
        for cid, why in m.rejected:
            self._reject(cid, why)
        if m.outputs:
            self._route(m.outputs, now)
        if m.stats is not None:
            self.stats = m.stats
            if self.on_stats is not None:
                self.on_stats(m.stats)

    def _stream_of(self, child_id: str) -> RequestStream | None:
        entry = self.outputs.child_to_parent.get(child_id)
        return self.streams.get(entry[0].request_id) if entry is not None else None

    def _reject(self, child_id: str, why: str) -> None:
        s = self._stream_of(child_id)
        if s is None:
            return
        self.streams.pop(s.request_id, None)
        others = [c for c in self.outputs.abort(s.request_id) if c != child_id]
        if others:
            self._send(ABORT, others)
        s._fail(RequestRejected(why))

    def _route(self, outputs: list[EngineCoreOutput], now: float) -> None:
        """Detokenize (OutputProcessor) and queue each touched child's delta on its stream."""
        touched: dict[str, list[int]] = {}
        for eco in outputs:
            entry = self.outputs.child_to_parent.get(eco.req_id)
            if entry is None:
                continue
            parent, i = entry
            if parent.children[i].out.finished:
                continue
            touched.setdefault(parent.request_id, []).append(i)
            s = self.streams.get(parent.request_id)
            if s is not None:
                t = s.timings
                t.first_scheduled = t.first_scheduled or eco.first_scheduled_time
                if eco.new_token_ids:
                    t.engine_first_token = t.engine_first_token or eco.first_token_time
                    t.first_output = t.first_output or now
        t0 = time.perf_counter()
        results, to_stop = self.outputs.process(outputs)
        self.detokenize_time_s += time.perf_counter() - t0
        if to_stop:
            self._send(STOP, to_stop)
        for ro in results:
            s = self.streams.get(ro.request_id)
            if s is None:
                continue
            deltas = []
            for i in touched.get(ro.request_id, ()):
                c = ro.outputs[i]
                deltas.append(ChildDelta(i, c.delta_text, list(c.delta_token_ids), c.delta_logprobs,
                                         c.finish_reason, c.stop_reason))
            s._put(deltas, ro.finished)
            if ro.finished:
                s.timings.finished = now
                del self.streams[ro.request_id]
                if self.on_finished is not None:
                    self.on_finished(s)
