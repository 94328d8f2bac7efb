"""This process's tensor-parallel group and the collectives the layers call.

One group per process, set by `init_tensor_parallel` before the model is built (each rank of an
engine: the engine process is rank 0, workers/tp_worker.py the others). Without it every
collective is the identity and rank / size are 0 / 1, so TP = 1 runs exactly the old code.
Every collective counts its bytes and seconds (`comm_stats`, benchmarks/scale_out.py reads them)."""

from __future__ import annotations

import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

# an idle engine waits for its next step inside a broadcast: no timeout may end it
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class CommStats:
    """Cumulative, this process: collectives called, bytes they moved in, seconds in them."""

    calls: int = 0
    all_reduce_bytes: int = 0
    all_gather_bytes: int = 0
    broadcast_bytes: int = 0
    time_s: float = 0.0


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    device: torch.device
    cpu_group: object = None       # gloo group for host objects (NCCL moves device tensors only)


_group: TPGroup | None = None
comm_stats = CommStats()


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the group (gloo on CPU, NCCL on CUDA); blocks until every rank has joined."""
    global _group
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=IDLE_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    _group = TPGroup(rank, size, device, cpu_group)


def destroy_tensor_parallel() -> None:
    global _group
    if _group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _group = None


@contextmanager
def replicated() -> Iterator[None]:
    """A scope in which this rank acts alone (rank 0 of 1): modules built in it are whole, as
    at TP = 1, and their forwards call no collective. Under TP every rank runs such a module on
    the same (replicated) inputs: the 4-bit draft head."""
    global _group
    saved, _group = _group, None
    try:
        yield
    finally:
        _group = saved


def tp_rank() -> int:
    return _group.rank if _group is not None else 0


def tp_size() -> int:
    return _group.size if _group is not None else 1


def _timed(kind: str, nbytes: int):
    comm_stats.calls += 1
    setattr(comm_stats, kind, getattr(comm_stats, kind) + nbytes)
    return time.perf_counter()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place; x itself with TP = 1."""
    if tp_size() == 1:
        return x
    t0 = _timed("all_reduce_bytes", x.numel() * x.element_size())
    dist.all_reduce(x)
    comm_stats.time_s += time.perf_counter() - t0
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """x [R, n] on each rank -> [R, n * size], the ranks' columns in rank order."""
    if tp_size() == 1:
        return x
    t0 = _timed("all_gather_bytes", x.numel() * x.element_size())
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    comm_stats.time_s += time.perf_counter() - t0
    return torch.cat(parts, dim=-1)


def broadcast_object(obj=None):
    """Rank 0's object on every rank (pickled; one length and one payload broadcast)."""
    if tp_size() == 1:
        return obj
    data = pickle.dumps(obj) if tp_rank() == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    t0 = _timed("broadcast_bytes", 8)
    group = _group.cpu_group
    dist.broadcast(n, 0, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if tp_rank() == 0
           else torch.empty(int(n), dtype=torch.uint8))
    comm_stats.broadcast_bytes += int(n)
    dist.broadcast(buf, 0, group=group)
    comm_stats.time_s += time.perf_counter() - t0
    return obj if tp_rank() == 0 else pickle.loads(buf.numpy().tobytes())


def all_min(value: int) -> int:
    """The smallest of the ranks' values (e.g. the KV blocks every rank can hold)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_group.cpu_group)
    return int(t)
