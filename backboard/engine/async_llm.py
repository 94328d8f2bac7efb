"""The front end's client of the engine process (the HTTP server's engine).

    front end (HTTP process, one asyncio loop)              engine process (core_proc.py)
    AsyncLLM.add_request                                    EngineCoreProc.run
      InputProcessor, ParentRequest
      queued; one frame per loop turn ──[ROUTER ─► DEALER]──► drain input (add / abort / stop)
                                                            │ step()
    RequestStream queues ◄─ OutputProcessor ◄──[PULL ◄─ PUSH: one StepOutputs per step]──┘
      (per request)         (detokenize, stop strings)

The front end never blocks on the engine: sends are non-blocking on unbounded sockets, outputs
arrive on a reader task of the loop, so there is no thread and no lock between the HTTP handlers
and the engine. A slow client's queue is bounded: past `max_pending_tokens` its request is
paused in the engine (PauseRequests) until the client takes its output (ResumeRequests).

If the engine dies (it reports a fatal error, or its process ends: the process sentinel), every
in-flight request fails with EngineDeadError, new ones are refused, and `dead` (a future) is
done, so the server can exit; nothing waits forever. The reason goes to the log; clients get a
message without the engine's exception text.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from backboard.config import EngineConfig
from backboard.core.outputs import EngineCoreOutput
from backboard.engine import messages as M
from backboard.engine.core_proc import run_engine_core
from backboard.engine.output_processor import CompletionOutput, RequestOutput
from backboard.engine.request_stream import (
    CompletionDelta,
    EngineDeadError,
    EngineStartError,
    RequestDelta,
    RequestRejected,
    RequestStream,
    RequestTimings,
)
from backboard.engine.transport import ENGINE_IDENTITY, EngineAddresses, bound_address, make_socket
from backboard.request import EngineCoreRequest
from backboard.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 0.5         # after the engine process ends, outputs it sent may still be in flight


class AsyncLLM:
    """Starts the engine process, sends requests and aborts, and routes step outputs to
    per-request streams (all on the asyncio loop it was started on).

    state: new -> starting -> ready -> (dead | stopped)"""

    def __init__(self, cfg: EngineConfig, tokenizer, log_level: str = "info",
                 on_stats: Callable[[M.EngineStats], None] | None = None,
                 on_finished: Callable[[RequestStream], None] | None = None,
                 addresses: str | None = None,
                 on_pause: Callable[[], None] | None = None,
                 launch: Callable[[EngineConfig, EngineAddresses, str], Any] | None = None) -> None:
        """launch(cfg, addresses, log_level) starts the engine process and returns it (default:
        spawn_engine; engine/ray_engines.py: a Ray actor with the same surface)."""
        from backboard.engine.output_processor import InputProcessor, OutputProcessor

        self.cfg, self.tokenizer, self.log_level = cfg, tokenizer, log_level
        self.address_spec, self.launch = addresses, launch or spawn_engine
        mc = cfg.model
        eos = tuple(dict.fromkeys(mc.eos_token_ids + tuple(tokenizer.eos_token_ids)))
        self.inputs = InputProcessor(tokenizer, cfg.scheduler.max_model_len, mc.vocab_size, eos)
        self.outputs = OutputProcessor(tokenizer)
        self.on_stats, self.on_finished, self.on_pause = on_stats, on_finished, on_pause
        self.streams: dict[str, RequestStream] = {}
        self.stats: M.EngineStats | None = None
        self.state = "new"
        self.error: str | None = None
        self.description = ""
        self.info: dict[str, Any] = {}   # the engine's configuration and build (engine_info.py)
        self.detokenize_time_s = 0.0     # cumulative: OutputProcessor.process on this loop
        self._ready: asyncio.Future | None = None
        self._hello = self._ready_msg = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None               # a multiprocessing.Process or engine/ray_engines.RayEngineProcess
        self._addrs: EngineAddresses | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._inp: zmq.asyncio.Socket | None = None
        self._out: zmq.asyncio.Socket | None = None
        self._out_sync: zmq.Socket | None = None      # the same socket, read from the loop's reader
        self._out_fd = -1
        self._tasks: list[asyncio.Task] = []
        self.dead: asyncio.Future | None = None      # done (with the reason) when the engine died
        self._outbox: list[M.InputMessage] = []       # sent together at the end of this loop turn
        self._enc, self._dec = M.encoder(), M.output_decoder()

    # ---- life cycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the sockets, spawn the engine process and start reading its outputs."""
        self._loop = loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self.dead = loop.create_future()
        self._bind(EngineAddresses.parse(self.address_spec))
        self._proc = self.launch(self.cfg, self._addrs, self.log_level)
        self.state = "starting"
        loop.add_reader(self._proc.sentinel, self._on_sentinel)
        loop.add_reader(self._out_fd, self._read_outputs)
        loop.call_soon(self._read_outputs)              # frames queued before the reader was added
        self._tasks = [asyncio.ensure_future(self._wait_hello())]

    def _bind(self, addrs: EngineAddresses) -> None:
        """Bind both sockets; the engine connects to the addresses they really got."""
        self._ctx = zmq.asyncio.Context(io_threads=1)
        self._inp = make_socket(self._ctx, zmq.ROUTER, addrs.input, bind=True)
        self._out = make_socket(self._ctx, zmq.PULL, addrs.output, bind=True)
        # read without zmq.asyncio's futures: a plain view of the same socket, drained from the loop's
        # reader on its FD (its machinery was a third of the front end's time per streamed token)
        self._out_sync = zmq.Socket.shadow(self._out.underlying)
        self._out_fd = self._out_sync.getsockopt(zmq.FD)
        self._addrs = EngineAddresses(bound_address(self._inp), bound_address(self._out), addrs.tmp_dir)

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
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._loop.remove_reader(self._proc.sentinel)
        if not was_dead and self._hello:
            self._send(M.Shutdown())
            self._flush()
        await self._join(timeout)
        for t in self._tasks:
            t.cancel()
        self._loop.remove_reader(self._out_fd)
        self._inp.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        self._addrs.cleanup()

    async def _join(self, timeout: float) -> None:
        proc, loop = self._proc, asyncio.get_running_loop()
        await loop.run_in_executor(None, proc.join, timeout)
        if proc.is_alive():
            proc.terminate()
            await loop.run_in_executor(None, proc.join, 5.0)
        if proc.is_alive():
            proc.kill()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                    prompt_text: str | None = None, arrival_time: float | None = None,
                    group: str | None = None, max_pending_tokens: int | None = None,
                    prefix_hint: int = 0) -> RequestStream:
        """Validate (InputError), register and send a request; returns its stream. `group`: what
        the engine's fair shares count it under (default: the request itself); `max_pending_tokens`:
        per completion, undelivered tokens before the request is paused (None: unbounded);
        `prefix_hint`: EngineCoreRequest's."""
        from backboard.engine.output_processor import ParentRequest

        self._check_alive()
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = arrival_time if arrival_time is not None else time.time()
        _, ecr = self.inputs.make_request(prompt_ids, params, request_id=request_id, arrival_time=arrival)
        parent = ParentRequest(request_id, prompt_text, ecr.prompt_token_ids, params, self.tokenizer, arrival,
                               cumulative=False)
        bound = None if max_pending_tokens is None else max_pending_tokens * params.n
        stream = RequestStream(request_id, params.n, len(ecr.prompt_token_ids), RequestTimings(arrival),
                               bound, lambda paused: self._pressure(request_id, paused))
        reqs = [EngineCoreRequest(cid, ecr.prompt_token_ids, parent.child_params(i), ecr.eos_token_ids,
                                  ecr.arrival_time, ecr.priority, group or request_id, prefix_hint)
                for i, cid in enumerate(self.outputs.add(parent))]
        self.streams[request_id] = stream
        stream.timings.sent = time.time()
        self._send(M.AddRequests(reqs))
        return stream

    def abort(self, request_id: str) -> None:
        """Forget a request and free what it holds in the engine (client gone, shutdown)."""
        stream = self.streams.pop(request_id, None)
        child_ids = self.outputs.abort(request_id)
        if child_ids and self.state == "ready":
            self._send(M.AbortRequests(child_ids))
        if stream is not None and not stream.finished:
            stream.abort()
            stream.timings.finished = time.time()
            if self.on_finished is not None:
                self.on_finished(stream)

    def _pressure(self, request_id: str, paused: bool) -> None:
        """Pause (or resume) a request's unfinished completions in the engine."""
        parent = self.outputs.parents.get(request_id)
        if parent is None or self.state != "ready":
            return
        ids = [parent.child_id(i) for i, c in enumerate(parent.children) if not c.out.finished]
        if ids:
            self._send(M.PauseRequests(ids) if paused else M.ResumeRequests(ids))
            if paused and self.on_pause is not None:
                self.on_pause()

    def fail_all(self, exc: BaseException) -> None:
        """End every request in flight with `exc` (e.g. the server is stopping) and abort them in
        the engine."""
        for rid, s in list(self.streams.items()):
            self.abort(rid)
            s.fail(exc)

    def _check_alive(self) -> None:
        if self.state == "ready":
            return
        if self.state in ("new", "starting"):
            raise EngineDeadError("the model is still loading")
        raise EngineDeadError(self.error or "the engine is not running")

    # ---- the sockets -----------------------------------------------------------------------
    def _send(self, msg: M.InputMessage) -> None:
        """Queue a message; everything queued in one loop turn goes out in one frame."""
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(msg)

    def _flush(self) -> None:
        msgs, self._outbox = self._outbox, []
        if not msgs or (self.state in ("dead", "stopped") and not isinstance(msgs[-1], M.Shutdown)):
            return                                # nobody to send to (a Shutdown still goes out)
        frame = self._enc.encode(msgs)
        sent = self._inp.send_multipart([ENGINE_IDENTITY, frame], flags=zmq.NOBLOCK, copy=False)
        if sent.exception() is not None:          # the engine is gone: its sentinel reports it
            logger.debug("send to the engine failed: %s", sent.exception())

    async def _wait_hello(self) -> None:
        """The engine's first frame on the input socket: from now on it can be sent to."""
        await self._inp.recv_multipart()
        self._hello = True
        self._maybe_ready()

    def _read_outputs(self) -> None:
        """Every frame waiting on the output socket. Its FD only says that the socket's events may
        have changed (edge-triggered): read until they show no more input, or frames would wait
        for the next one."""
        sock = self._out_sync
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            try:
                msg = self._dec.decode(frame.buffer)
            except msgspec.ValidationError:
                logger.exception("a malformed frame from the engine")
                continue
            try:
                self._on_message(msg)
            except Exception:  # noqa: BLE001 - the next frames must still be read
                logger.exception("handling a message from the engine failed")

    def _on_sentinel(self) -> None:
        """The engine process ended. Whatever it sent before may still be in flight: read on for
        a moment, then fail what is left (a normal exit follows a Shutdown: state is stopped)."""
        self._loop.remove_reader(self._proc.sentinel)
        self._loop.call_later(EXIT_GRACE_S, lambda: self._on_exit(self._proc.exitcode))

    # ---- on the event loop ---------------------------------------------------------------
    def _on_message(self, msg: M.OutputMessage) -> None:
        try:
            self._handle_message(msg)
        except Exception:  # noqa: BLE001 - a bug here must not take every request down
            logger.exception("failed to process an engine message")

    def _handle_message(self, msg: M.OutputMessage) -> None:
        if isinstance(msg, M.StepOutputs):
            self._on_step(msg)
        elif isinstance(msg, M.EngineReady):
            self.description, self.info, self._ready_msg = msg.description, msg.info, True
            self._maybe_ready()
        elif isinstance(msg, M.EngineStartFailed):
            self.state, self.error = "dead", msg.message
            if not self._ready.done():
                self._ready.set_exception(EngineStartError(msg.kind, msg.message))
        elif isinstance(msg, M.EngineFailed):
            self._die(f"the engine failed: {msg.message}", "the engine failed (the server log says why)")

    def _maybe_ready(self) -> None:
        """Ready once the engine loaded the model and the ROUTER has seen it (either order)."""
        if self._hello and self._ready_msg and self.state == "starting":
            self.state = "ready"
            if not self._ready.done():
                self._ready.set_result(self.description)

    def _on_exit(self, exitcode: int | None) -> None:
        if self.state == "stopped":
            return
        code = "" if exitcode is None else f" (exit code {exitcode})"
        self._die(f"the engine process exited unexpectedly{code}")

    def _die(self, why: str, public: str | None = None) -> None:
        """The engine is gone: `why` is logged; clients see `public` (no exception text)."""
        if self.state in ("dead", "stopped"):
            return
        logger.error(why)
        self.state, self.error = "dead", public or why
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineDeadError(self.error))
        if self.dead is not None and not self.dead.done():
            self.dead.set_result(why)
        self._fail_all(EngineDeadError(self.error))

    def _fail_all(self, exc: BaseException) -> None:
        for s in self.streams.values():
            s.fail(exc)
        self.streams.clear()

    def _on_step(self, m: M.StepOutputs) -> None:
        now = time.time()
        for rid, t in m.received.items():
            s = self._stream_of(rid)
            if s is not None and s.timings.engine_received is None:
                s.timings.engine_received = t
        for rid, why in m.rejected:
            self._reject(rid, why)
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
            self._send(M.AbortRequests(others))
        s.fail(RequestRejected(why))

    def _route(self, outputs: list[EngineCoreOutput], now: float) -> None:
        """Detokenize (OutputProcessor) and queue each touched request's delta on its stream."""
        touched = self._touched(outputs, now)
        t0 = time.perf_counter()
        results, to_stop = self.outputs.process(outputs)
        self.detokenize_time_s += time.perf_counter() - t0
        if to_stop:
            self._send(M.StopRequests(to_stop))
        for ro in results:
            s = self.streams.get(ro.request_id)
            if s is None:
                continue
            s.push(_delta(ro, touched.get(ro.request_id, ())))
            if ro.finished:
                s.timings.finished = now
                del self.streams[ro.request_id]
                if self.on_finished is not None:
                    self.on_finished(s)

    def _touched(self, outputs: list[EngineCoreOutput], now: float) -> dict[str, list[int]]:
        """request id -> the completions these outputs advance; stamps first-token timings."""
        touched: dict[str, list[int]] = {}
        for eco in outputs:
            entry = self.outputs.child_to_parent.get(eco.req_id)
            if entry is None or entry[0].children[entry[1]].out.finished:
                continue
            parent, i = entry
            touched.setdefault(parent.request_id, []).append(i)
            s = self.streams.get(parent.request_id)
            if s is not None:
                t = s.timings
                t.first_scheduled = t.first_scheduled or eco.first_scheduled_time
                if eco.new_token_ids:
                    t.engine_first_token = t.engine_first_token or eco.first_token_time
                    t.first_output = t.first_output or now
        return touched


def spawn_engine(cfg: EngineConfig, addrs: EngineAddresses, log_level: str) -> mp.process.BaseProcess:
    """The engine process on this machine (engine/core_proc.run_engine_core), started."""
    proc = mp.get_context("spawn").Process(target=run_engine_core, name="backboard-engine", daemon=True,
                                           args=(cfg, addrs, log_level))
    proc.start()
    return proc


def _delta(ro: RequestOutput, indices) -> RequestDelta:
    """The step's RequestDelta of a request, from its (cumulative) RequestOutput."""
    return RequestDelta(ro.request_id, [_completion_delta(ro.outputs[i]) for i in indices], ro.finished,
                        len(ro.prompt_token_ids), sum(len(c.token_ids) for c in ro.outputs),
                        ro.prompt_logprobs if ro.finished else None, ro.num_cached_tokens)


def _completion_delta(c: CompletionOutput) -> CompletionDelta:
    return CompletionDelta(c.index, c.delta_text, list(c.delta_token_ids), c.delta_logprobs,
                           c.finish_reason, c.stop_reason)
