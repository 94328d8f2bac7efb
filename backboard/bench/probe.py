"""How fast this machine reads memory right now: recorded beside every benchmark point.

On the shared VMs this project measures on, the read bandwidth moved 31-65 GB/s within minutes
(benchmarks/results/cpu-scorecard-20261202c-1024-partial/README.md), and a CPU decode step is
bound by it: a point measured in a slow moment loses ~15-20% for the machine's sake, not the
engine's. The sweep records the probe before and after each point so that a disagreeing run pair
can be told apart from a real difference.

    gbps = read_gbps()        # best of a few timed sums over PROBE_BYTES, all torch threads
"""

from __future__ import annotations

import functools
import time

PROBE_BYTES = 256 << 20         # well past any last-level cache


@functools.lru_cache(maxsize=1)
def _buffer():
    import torch

    return torch.ones(PROBE_BYTES // 4, dtype=torch.float32)    # touched: its pages exist


def read_gbps(reps: int = 5) -> float:
    """GB/s of the fastest of `reps` sums over a PROBE_BYTES buffer (kept for the process)."""
    buf = _buffer()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return PROBE_BYTES / best / 1e9
