"""Rank 0's side of tensor parallelism: start ranks 1..N-1 (worker/tp_worker.py) and join their
group. The engine process is rank 0 itself: its ModelRunner broadcasts each step's
SchedulerOutput and the sampled tokens, so the scheduler stays one process.

    MultiprocTPWorkers   spawned processes on this machine (--distributed-executor-backend mp)
    engine/ray_executor  the same contract on a Ray cluster (ray)

`sentinels` lets the engine loop notice a dead rank while idle; inside a step a dead rank makes
the collective fail. Either way the engine stops loudly (EngineFailed)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from dataclasses import replace

import torch

from backboard.config import EngineConfig
from backboard.distributed.parallel_state import broadcast_object, destroy_tensor_parallel, init_tensor_parallel
from backboard.worker.tp_worker import run_tp_worker

logger = logging.getLogger(__name__)


class RankDied(RuntimeError):
    """A tensor-parallel rank ended while the engine was running."""


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """A tcp:// init method on a port free now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    """A rank's config: its own GPU on CUDA (the engine's first GPU + rank), the same CPU otherwise."""
    if not cfg.device.startswith("cuda"):
        return cfg
    first = int(cfg.device.partition(":")[2] or 0)
    return replace(cfg, device=f"cuda:{first + rank}")


class MultiprocTPWorkers:
    """Ranks 1..N-1 as spawned processes (daemonic: they end with the engine process)."""

    def __init__(self, cfg: EngineConfig, log_level: str = "INFO") -> None:
        size = cfg.parallel.tensor_parallel_size
        addr = free_tcp_address()
        threads = torch.get_num_threads() if cfg.device == "cpu" else None
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=run_tp_worker, name=f"backboard-tp{r}", daemon=True,
                                  args=(rank_config(cfg, r), r, size, addr, threads, log_level))
                      for r in range(1, size)]
        _start_children(self.procs)
        init_tensor_parallel(0, size, addr, torch.device(rank_config(cfg, 0).device))
        logger.info("tensor parallel: %d ranks (gloo/nccl group at %s)", size, addr)

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    def check_alive(self) -> None:
        for p in self.procs:
            if not p.is_alive():
                raise RankDied(f"tensor-parallel rank {p.name} exited with code {p.exitcode}")

    def shutdown(self) -> None:
        """Tell the ranks to stop, then make sure they did."""
        try:
            if all(p.is_alive() for p in self.procs):
                broadcast_object(None)
        finally:
            for p in self.procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
            destroy_tensor_parallel()


def _start_children(procs: list) -> None:
    """Start the ranks even from a daemonic engine process (multiprocessing refuses children of
    a daemon; ours are daemonic too and watch their parent, so none outlives it)."""
    me = mp.current_process()
    was = me._config.get("daemon", False)
    me._config["daemon"] = False
    try:
        for p in procs:
            p.start()
    finally:
        me._config["daemon"] = was


def start_tp_workers(cfg: EngineConfig):
    """The other ranks of this engine, by the configured backend (None: TP = 1)."""
    if cfg.parallel.tensor_parallel_size == 1:
        return None
    if cfg.parallel.distributed_executor_backend == "ray":
        from backboard.worker.ray_executor import RayTPWorkers

        return RayTPWorkers(cfg)
    return MultiprocTPWorkers(cfg, logging.getLevelName(logging.getLogger().level))
