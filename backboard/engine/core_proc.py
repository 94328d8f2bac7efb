"""The engine process: EngineCore behind two ZeroMQ sockets (engine/transport.py).

    run_engine_core (spawned)   connect; load the model; EngineReady or EngineStartFailed
    EngineCoreProc.run          idle: block on input (or the front end's exit)
                                busy: drain input; step(); one StepOutputs per step

The process owns EngineCore and nothing else: no JSON, no tokenization, no client sockets. It
busy-steps while it has work and blocks on its input socket when idle. It leaves when told to
(Shutdown), when its parent process (the front end) is gone, or, on an error in the loop, after
sending EngineFailed (then with exit code 1).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import traceback

import zmq

from backboard.config import EngineConfig
from backboard.core.heap import freeze_startup_heap
from backboard.core.outputs import SchedulerStats
from backboard.engine import messages as M
from backboard.engine.cpu_threads import set_engine_threads
from backboard.engine.transport import ENGINE_IDENTITY, EngineAddresses, make_socket
from backboard.worker.tp_executor import RankDied

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5


class FrontEndGone(Exception):
    """The front end's process ended: nobody is left to serve."""


class EngineIO:
    """The engine process's ends of the sockets (plain, blocking zmq), and the front end's
    liveness (its process sentinel, polled with the input socket)."""

    def __init__(self, addrs: EngineAddresses, identity: bytes = ENGINE_IDENTITY) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.inp = make_socket(self.ctx, zmq.DEALER, addrs.input, bind=False, identity=identity)
        self.out = make_socket(self.ctx, zmq.PUSH, addrs.output, bind=False)
        self.enc, self.dec = M.encoder(), M.input_decoder()
        self.poller = zmq.Poller()
        self.poller.register(self.inp, zmq.POLLIN)
        parent = mp.parent_process()
        self.parent = parent.sentinel if parent is not None else None
        if self.parent is not None:
            self.poller.register(self.parent, zmq.POLLIN)
        self.ranks: list[int] = []                  # sentinels of the other TP ranks
        self.inp.send(b"")                          # announce this engine to the ROUTER

    def watch_ranks(self, sentinels: list[int]) -> None:
        """Also wake (and fail) when one of these processes (the engine's other TP ranks) ends."""
        self.ranks = list(sentinels)
        for s in self.ranks:
            self.poller.register(s, zmq.POLLIN)

    def send(self, msg: M.OutputMessage) -> None:
        self.out.send(self.enc.encode(msg), copy=False)

    def recv(self, timeout_ms: int | None) -> list[M.InputMessage]:
        """Every input message waiting, after waiting up to `timeout_ms` for one (None: forever)."""
        ready = dict(self.poller.poll(timeout_ms))
        if self.parent is not None and self.parent in ready:
            raise FrontEndGone()
        if any(r in ready for r in self.ranks):
            raise RankDied("a tensor-parallel rank of this engine exited")
        msgs: list[M.InputMessage] = []
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return msgs
            msgs.extend(self.dec.decode(frame.buffer))

    def close(self) -> None:
        """Deliver what is queued (up to the linger time), then close."""
        self.inp.close(linger=0)
        self.out.close()
        self.ctx.term()


def run_engine_core(cfg: EngineConfig, addrs: EngineAddresses, log_level: str = "INFO") -> None:
    """Entry point of the engine process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the front end decides when to stop
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s [engine] %(levelname)s %(message)s")
    io = EngineIO(addrs)
    core = _start_core(cfg, io)
    code = 0 if core is None else _serve(core, io)
    if core is not None and code == 0:
        core.shutdown()                               # the other TP ranks (on failure they see it)
    io.close()
    if code:
        os._exit(code)


def _start_core(cfg: EngineConfig, io: EngineIO):
    """The EngineCore, announced as ready; None (after EngineStartFailed) when it cannot load."""
    try:
        set_engine_threads(cfg)                       # before the model loads
        from backboard.engine.engine_core import EngineCore

        core = EngineCore(cfg)
    except Exception as e:  # noqa: BLE001 - reported to the front end, which prints it
        logger.debug("engine start-up failed", exc_info=True)
        io.send(M.EngineStartFailed(type(e).__name__, str(e)))
        return None
    if core.tp_workers is not None:
        io.watch_ranks(core.tp_workers.sentinels)
    freeze_startup_heap()
    io.send(M.EngineReady(core.describe(), core.info()))
    return core


def _serve(core, io: EngineIO) -> int:
    """Run the loop; the process's exit code."""
    try:
        EngineCoreProc(core, io).run()
    except FrontEndGone:
        logger.info("the front end is gone; exiting")
    except Exception as e:  # noqa: BLE001
        logger.error("engine loop failed:\n%s", traceback.format_exc())
        io.send(M.EngineFailed(f"{type(e).__name__}: {e}"))
        return 1
    return 0


class EngineCoreProc:
    """The loop of the engine process: drain input, step while there is work, send one message per
    step; block on the input socket while idle."""

    def __init__(self, core, io: EngineIO) -> None:
        self.core, self.io = core, io
        self.start = time.time()
        self.step_time_s = 0.0
        self.pending = M.StepOutputs()
        self.last_stats: tuple[SchedulerStats, int] | None = None
        self.last_stats_time = 0.0
        self.stats_owed = False            # stats held back by the interval, to send when due

    def run(self) -> None:
        while self._apply(self.io.recv(self._wait_ms())):
            if self.core.has_work():
                self._step()
            self._flush()

    def _wait_ms(self) -> int | None:
        """How long to wait for input: not at all with work; while idle, until held-back stats are
        due (None: until input comes)."""
        if self.core.has_work():
            return 0
        if not self.stats_owed:
            return None
        return max(0, int(1000 * (self.last_stats_time + STATS_INTERVAL_S - time.time())) + 1)

    def _step(self) -> None:
        t0 = time.perf_counter()
        outs = self.core.step()
        self.step_time_s += time.perf_counter() - t0
        self.pending.outputs.extend(outs)

    # ---- input ---------------------------------------------------------------------------
    def _apply(self, msgs: list[M.InputMessage]) -> bool:
        """Apply front-end messages in order; False on Shutdown."""
        for m in msgs:
            if isinstance(m, M.AddRequests):
                self._add(m.requests)
            elif isinstance(m, M.AbortRequests):
                self.core.abort_requests(m.request_ids)   # the front end already forgot them
            elif isinstance(m, M.StopRequests):
                self.core.stop_requests(m.request_ids)
            elif isinstance(m, M.PauseRequests):
                self.core.scheduler.pause_requests(m.request_ids)
            elif isinstance(m, M.ResumeRequests):
                self.core.scheduler.resume_requests(m.request_ids)
            elif isinstance(m, M.Shutdown):
                return False
        return True

    def _add(self, reqs) -> None:
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
        msg.stats = self._stats_if_due()
        if not msg.is_empty:
            self.io.send(msg)
            self.pending = M.StepOutputs()

    def _stats_if_due(self) -> M.EngineStats | None:
        """Stats on change, at most every STATS_INTERVAL_S; those held back while going idle are
        sent when due (run() waits for them). Sending every idle moment at once made a closed
        loop of short requests report 'nothing running' in most messages."""
        now = time.time()
        self.stats_owed = now - self.last_stats_time < STATS_INTERVAL_S
        if self.stats_owed:
            return None
        s = self.core.stats()
        key = (s, self.core.num_steps)
        if key == self.last_stats:
            return None
        self.last_stats, self.last_stats_time = key, now
        return M.EngineStats(s, self.core.num_steps, self.step_time_s, now - self.start, now,
                             self.core.num_tokens_generated, self.core.phase_times())
