"""How many cores compute on a CPU device, for each process.

    set_engine_threads(cfg)      the engine (its process, or the offline LLM): cfg.cpu_threads
                                 (--cpu-threads), else $OMP_NUM_THREADS when set, else every core
                                 this process may run on, shared by the TP ranks and DP engines
                                 (each rank gets cores // (TP x DP); other ranks take rank 0's)
    set_frontend_threads()       the HTTP front end: one torch thread, so nothing it runs (the
                                 tokenizer's tensors, a stray torch op) spins OpenMP workers on
                                 the cores the step computes on

The step is the bottleneck on a CPU: leaving a core to the front end halves a 2-core machine's
arithmetic, while the front end (uvloop, one process) needs a millisecond or two per step
(benchmarks/frontend_share.py measures both processes' CPU time under load).
"""

from __future__ import annotations

import logging
import os

from backboard.config import EngineConfig

logger = logging.getLogger(__name__)


def default_cpu_threads() -> int:
    """Every core this process may run on (its affinity mask: taskset, cgroups' cpusets)."""
    return max(1, len(os.sched_getaffinity(0)))


def engine_threads(cfg: EngineConfig) -> int | None:
    """The engine's torch thread count per tensor-parallel rank (ranks and engines share the cores);
    None: leave torch's ($OMP_NUM_THREADS, the user's)."""
    if not cfg.device.startswith("cpu"):
        return None
    if cfg.cpu_threads is not None:
        return cfg.cpu_threads
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    p = cfg.parallel
    return max(1, default_cpu_threads() // (p.tensor_parallel_size * p.data_parallel_size))


def set_engine_threads(cfg: EngineConfig) -> None:
    n = engine_threads(cfg)
    if n is None:
        return
    import torch

    torch.set_num_threads(n)
    logger.info("engine: %d CPU thread(s)", n)


def set_frontend_threads() -> None:
    """One torch thread in the front end's process (a no-op when it never imported torch)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
