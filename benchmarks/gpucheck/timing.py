"""Timing and comparison helpers, and the calibration (copy bandwidth, bf16 matmul rate) the
floors are measured against."""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.gpucheck.plan import GB, Plan


# ==== helpers ===================================================================================
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of fn() in milliseconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(max(1, reps)):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float, **info) -> dict:
    o, r = out.float(), ref.float()
    diff = (o - r)
    finite = bool(torch.isfinite(o).all())
    rel = float(diff.norm() / r.norm().clamp_min(1e-30))
    res = dict(name=name, max_abs=float(diff.abs().max()) if diff.numel() else 0.0, rel_l2=rel,
               tol=tol, ok=bool(finite and rel <= tol), **info)
    return res


def _copy_bandwidth(dev: torch.device, nbytes: int, warmup: int, reps: int) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), dev, warmup, reps)
    return 2 * nbytes / (ms * 1e-3)


def _matmul_rate(dev: torch.device, dtype: torch.dtype, n: int, warmup: int, reps: int) -> float:
    """FLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    ms = time_ms(lambda: a @ b, dev, warmup, reps)
    return 2 * n ** 3 / (ms * 1e-3)


def calibrate(plan: Plan) -> dict:
    warm, reps = (1, 2) if plan.smoke else (2, 10)
    nbytes = (64 << 20) if plan.smoke else (4 << 30)
    n = 256 if plan.smoke else 8192
    bw = _copy_bandwidth(plan.device, nbytes, warm, reps)
    rate = _matmul_rate(plan.device, plan.dtype, n, warm, reps)
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(copy_bandwidth_GBps=bw / GB, copy_bytes=2 * nbytes, matmul_TFLOPs=rate / 1e12, matmul_size=n)


def graph_time_ms(step, warmup: int, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(max(2, warmup)):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    try:
        return time_ms(graph.replay, torch.device("cuda"), 2, reps)
    finally:
        del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
