"""Data parallelism: N engines behind the one front end (`--data-parallel-size N`).

Each engine is an `AsyncLLM` of its own (its process, its ZeroMQ ROUTER / PULL pair), so every
message about a request (abort, stop, pause, resume) goes through the engine that holds it by
construction. `DPAsyncLLM` has AsyncLLM's surface, which is all the server uses:

    add_request   to the least-loaded engine: fewest requests in flight (the front end's own
                  count, exact), then lowest KV cache usage (its last stats), then the lowest index
    stats         the engines' stats combined (counts summed, usages averaged): /metrics totals;
                  `on_engine_stats(i, stats)` gets each engine's own (/metrics per engine)
    state / dead  ready when all are; one engine dying is the server's death (as for one engine)

Engine i computes on cores // (DP x TP) threads per rank (engine/cpu_threads.py), on CUDA on
GPUs i*TP .. i*TP + TP - 1. With `--distributed-executor-backend ray` the engines are Ray actors
in a placement group (engine/ray_engines.py) and connect to the front end over tcp://."""

from __future__ import annotations

import asyncio
import os
from dataclasses import fields, replace
from typing import Any, Callable

from backboard.config import EngineConfig
from backboard.core.outputs import SchedulerStats
from backboard.engine import messages as M
from backboard.engine.async_llm import AsyncLLM
from backboard.engine.request_stream import RequestStream


def engine_config(cfg: EngineConfig, i: int) -> EngineConfig:
    """Engine i's config: its data-parallel rank and, on CUDA, its first GPU."""
    cfg = replace(cfg, parallel=replace(cfg.parallel, data_parallel_rank=i))
    if cfg.device.startswith("cuda"):
        cfg = replace(cfg, device=f"cuda:{i * cfg.parallel.tensor_parallel_size}")
    return cfg


def engine_address(spec: str | None, i: int) -> str | None:
    """Engine i's sockets: a fresh ipc dir (None), DIR/engine-i, or ports PORT + 2i, PORT + 2i + 1."""
    if spec is None or spec.startswith("ipc://"):
        return None if spec is None else os.path.join(spec, f"engine-{i}")
    host, _, port = spec.rpartition(":")
    return spec if int(port) == 0 else f"{host}:{int(port) + 2 * i}"


def combine_stats(stats: list[M.EngineStats]) -> M.EngineStats:
    """The engines' stats as one: counts and times summed, usages averaged, the newest time."""
    n = len(stats)
    kw: dict[str, Any] = {}
    for f in fields(SchedulerStats):
        vals = [getattr(s.scheduler, f.name) for s in stats]
        if f.name.endswith("_usage"):
            kw[f.name] = sum(vals) / n
        elif isinstance(vals[0], list):
            width = max(len(v) for v in vals)
            kw[f.name] = [sum(v[j] for v in vals if j < len(v)) for j in range(width)]
        else:
            kw[f.name] = sum(vals)
    phases = {k: sum(s.phase_time_s.get(k, 0.0) for s in stats) for k in stats[0].phase_time_s}
    return M.EngineStats(SchedulerStats(**kw), sum(s.num_steps for s in stats), sum(s.step_time_s for s in stats),
                         max(s.uptime_s for s in stats), max(s.time for s in stats),
                         sum(s.num_generation_tokens for s in stats), phases)


class DPAsyncLLM:
    """N AsyncLLM engines as one (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, tokenizer, log_level: str = "info",
                 on_stats: Callable[[M.EngineStats], None] | None = None,
                 on_finished: Callable[[RequestStream], None] | None = None,
                 addresses: str | None = None, on_pause: Callable[[], None] | None = None,
                 on_engine_stats: Callable[[int, M.EngineStats], None] | None = None) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.on_stats, self.on_finished, self.on_engine_stats = on_stats, on_finished, on_engine_stats
        self.ray = None
        if cfg.parallel.distributed_executor_backend == "ray":
            from backboard.engine.ray_engines import RayEngines

            self.ray = RayEngines(cfg)
            addresses = addresses or self.ray.address()
        self.engines = [AsyncLLM(engine_config(cfg, i), tokenizer, log_level,
                                 on_stats=lambda st, i=i: self._stats_of(i, st),
                                 on_finished=self._finished, addresses=engine_address(addresses, i),
                                 on_pause=on_pause, launch=self.ray.launcher(i) if self.ray else None)
                        for i in range(cfg.parallel.data_parallel_size)]
        self.owner: dict[str, AsyncLLM] = {}           # request id -> the engine serving it
        self.engine_stats: list[M.EngineStats | None] = [None] * len(self.engines)
        self.routed = [0] * len(self.engines)          # requests sent to each engine
        self.stats: M.EngineStats | None = None
        self.dead: asyncio.Future | None = None

    # ---- life cycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self.dead = asyncio.get_running_loop().create_future()
        for e in self.engines:
            await e.start()
            e.dead.add_done_callback(self._engine_died)

    def _engine_died(self, fut: asyncio.Future) -> None:
        if not self.dead.done() and not fut.cancelled():
            self.dead.set_result(fut.result())

    async def wait_ready(self) -> str:
        lines = await asyncio.gather(*(e.wait_ready() for e in self.engines))
        return f"{len(lines)} data-parallel engines, each: {lines[0]}"

    async def shutdown(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(e.shutdown(timeout) for e in self.engines))
        if self.ray is not None:
            self.ray.shutdown()

    @property
    def state(self) -> str:
        states = [e.state for e in self.engines]
        for s in ("dead", "stopped", "new", "starting"):
            if s in states:
                return s
        return "ready"

    @property
    def error(self) -> str | None:
        return next((e.error for e in self.engines if e.error), None)

    @property
    def pid(self) -> int | None:
        return self.engines[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [e.pid for e in self.engines]

    @property
    def description(self) -> str:
        return self.engines[0].description

    @property
    def info(self) -> dict[str, Any]:
        return {**self.engines[0].info, "data_parallel_size": len(self.engines)}

    @property
    def detokenize_time_s(self) -> float:
        return sum(e.detokenize_time_s for e in self.engines)

    @property
    def num_unfinished(self) -> int:
        return sum(e.num_unfinished for e in self.engines)

    # ---- requests ------------------------------------------------------------------------
    def least_loaded(self) -> int:
        """The engine index a new request goes to."""
        def load(i: int):
            st = self.engine_stats[i]
            return self.engines[i].num_unfinished, st.scheduler.kv_cache_usage if st else 0.0, i
        return min(range(len(self.engines)), key=load)

    def add_request(self, prompt_ids: list[int], params, request_id: str, **kw) -> RequestStream:
        if request_id in self.owner and request_id in self.owner[request_id].streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        i = self.least_loaded()
        stream = self.engines[i].add_request(prompt_ids, params, request_id, **kw)
        self.owner[request_id] = self.engines[i]
        self.routed[i] += 1
        return stream

    def abort(self, request_id: str) -> None:
        eng = self.owner.pop(request_id, None)
        if eng is not None:
            eng.abort(request_id)

    def fail_all(self, exc: BaseException) -> None:
        for e in self.engines:
            e.fail_all(exc)

    def _finished(self, s: RequestStream) -> None:
        self.owner.pop(s.request_id, None)
        if self.on_finished is not None:
            self.on_finished(s)

    def _stats_of(self, i: int, st: M.EngineStats) -> None:
        self.engine_stats[i] = st
        if self.on_engine_stats is not None:
            self.on_engine_stats(i, st)
        known = [s for s in self.engine_stats if s is not None]
        self.stats = combine_stats(known)
        if self.on_stats is not None:
            self.on_stats(self.stats)


def engine_client(cfg: EngineConfig, tokenizer, **kw):
    """The front end's engine: one AsyncLLM, or DPAsyncLLM with data_parallel_size > 1."""
    if cfg.parallel.data_parallel_size > 1:
        return DPAsyncLLM(cfg, tokenizer, **kw)
    kw.pop("on_engine_stats", None)
    return AsyncLLM(cfg, tokenizer, **kw)
