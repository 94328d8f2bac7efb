"""A tensor-parallel rank other than 0: its own ModelRunner over its shard of the model, stepping
on the SchedulerOutput rank 0 broadcasts (worker/model_runner.py sends it once per step), until
rank 0 broadcasts None. It never schedules and never answers: rank 0 samples and broadcasts the
tokens, so every rank commits the same ones.

It leaves when told, when a collective fails (a rank or the engine died: the connection closes),
or when its parent (the engine process) is gone: no orphans."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading

from backboard.config import EngineConfig
from backboard.core.heap import freeze_startup_heap

logger = logging.getLogger(__name__)


def watch_parent() -> None:
    """Exit at once when the process that started this one ends."""
    parent = mp.parent_process()
    if parent is None:
        return

    def wait() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=wait, name="parent-watch", daemon=True).start()


def run_tp_worker(cfg: EngineConfig, rank: int, size: int, init_method: str, threads: int | None,
                  log_level: str = "INFO") -> None:
    """Entry point of rank `rank` (spawned by worker/tp_executor.py, or a Ray actor's task)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the engine decides when to stop
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s [tp rank {rank}] %(levelname)s %(message)s")
    watch_parent()
    try:
        serve_rank(cfg, rank, size, init_method, threads)
    except Exception:  # noqa: BLE001 - the engine sees the collective fail and stops loudly
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)


def serve_rank(cfg: EngineConfig, rank: int, size: int, init_method: str, threads: int | None) -> None:
    """Join the group, load this rank's shard, step until told to stop."""
    import torch

    from backboard.distributed.parallel_state import broadcast_object, destroy_tensor_parallel, init_tensor_parallel
    from backboard.worker.model_runner import ModelRunner

    if threads is not None:
        torch.set_num_threads(threads)
    init_tensor_parallel(rank, size, init_method, torch.device(cfg.device))
    runner = ModelRunner(cfg, _proposer(cfg))
    freeze_startup_heap()
    while (so := broadcast_object()) is not None:
        runner.execute_model(so)
    destroy_tensor_parallel()


def _proposer(cfg: EngineConfig):
    if cfg.spec is None:
        return None
    from backboard.spec_decode import build_proposer

    return build_proposer(cfg)
