"""Tensor-parallel ranks 1..N-1 as Ray actors (`--distributed-executor-backend ray`): the same
contract as MultiprocTPWorkers (worker/tp_executor.py), on whatever nodes the Ray cluster has.

    ray start --head                      (first machine)     ray start --address HEAD:6379 (others)
    backboard serve MODEL --tensor-parallel-size N --distributed-executor-backend ray

The engine process is rank 0 and the Ray driver: it joins the cluster of $RAY_ADDRESS (or the one
`ray start` made on this machine, or starts a local one), reserves one bundle per other rank in a
placement group (a GPU each on CUDA, a CPU otherwise), checks that every actor runs the same
backboard and torch versions as itself (a mismatch stops start-up naming both), then every rank
joins the torch.distributed group at rank 0's address. The actors belong to the engine process:
Ray ends them with it. A rank that ends wakes the engine loop through a pipe (`sentinels`)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace

import torch

from backboard.config import ConfigError, EngineConfig
from backboard.distributed.parallel_state import broadcast_object, destroy_tensor_parallel, init_tensor_parallel
from backboard.worker.tp_executor import RankDied, free_tcp_address, rank_config

logger = logging.getLogger(__name__)


def versions() -> dict[str, str]:
    import backboard

    return {"backboard": backboard.__version__, "torch": torch.__version__}


def check_versions(here: dict[str, str], there: list[tuple[str, dict[str, str]]]) -> None:
    """ConfigError naming the first package whose version differs on a node from this one's."""
    for node, v in there:
        for name, mine in here.items():
            if v.get(name) != mine:
                raise ConfigError(f"version mismatch: {name} {v.get(name)} on node {node}, {mine} on the engine's "
                                  "node; install the same backboard and torch on every node of the Ray cluster")


class _Rank:
    """One rank's actor: reports where it runs and what it runs, then serves the rank."""

    def node(self) -> tuple[str, dict[str, str]]:
        import ray

        return ray.util.get_node_ip_address(), versions()

    def run(self, cfg: EngineConfig, rank: int, size: int, init_method: str, threads: int | None) -> None:
        from backboard.worker.tp_worker import serve_rank

        serve_rank(cfg, rank, size, init_method, threads)


class RayTPWorkers:
    def __init__(self, cfg: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        connect_ray()
        size, gpu = cfg.parallel.tensor_parallel_size, cfg.device.startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([bundle] * (size - 1), strategy="PACK")
        ray.get(self.pg.ready(), timeout=300)
        cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_Rank)
        self.actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i)).remote()
                       for i in range(size - 1)]
        check_versions(versions(), ray.get([a.node.remote() for a in self.actors]))
        addr = free_tcp_address(ray.util.get_node_ip_address())
        threads = torch.get_num_threads() if cfg.device == "cpu" else None
        acfg = replace(cfg, device="cuda:0") if gpu else cfg      # Ray shows each actor its one GPU
        self.runs = [a.run.remote(acfg, r, size, addr, threads) for r, a in enumerate(self.actors, 1)]
        init_tensor_parallel(0, size, addr, torch.device(rank_config(cfg, 0).device))
        self._r, self._w = os.pipe()
        threading.Thread(target=self._watch, name="ray-rank-watch", daemon=True).start()
        logger.info("tensor parallel: %d ranks on Ray (group at %s)", size, addr)

    def _watch(self) -> None:
        import ray

        ray.wait(self.runs, num_returns=1, timeout=None)
        os.write(self._w, b"x")

    @property
    def sentinels(self) -> list[int]:
        return [self._r]

    def check_alive(self) -> None:
        import ray

        done, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if done:
            raise RankDied("a tensor-parallel rank on Ray ended")

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            broadcast_object(None)
            ray.get(self.runs, timeout=10)
        except Exception as e:  # noqa: BLE001 - stopping anyway
            logger.debug("ray ranks did not stop cleanly: %s", e)
        finally:
            for a in self.actors:
                ray.kill(a)
            remove_placement_group(self.pg)
            destroy_tensor_parallel()


def connect_ray() -> None:
    """Join the cluster of $RAY_ADDRESS (or the one `ray start` made here, or start a local one),
    unless this process is in one already (the driver, or an actor: a DP engine on Ray)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), runtime_env=_runtime_env(), log_to_driver=False)


def _runtime_env() -> dict:
    """The actors import this backboard: its source folder joins their PYTHONPATH."""
    import backboard

    src = os.path.dirname(os.path.dirname(os.path.abspath(backboard.__file__)))
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}
