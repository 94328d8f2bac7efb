"""Data-parallel engines as Ray actors (`--data-parallel-size N --distributed-executor-backend ray`).

    RayEngines            joins the Ray cluster, reserves one bundle per engine in a placement
                          group (a GPU and a CPU each on CUDA; on CPUs the engine's threads,
                          engine/cpu_threads.py, which Ray gives it as OMP_NUM_THREADS), checks that every
                          node runs this backboard and torch; `launcher(i)` starts engine i
    RayEngineProcess      one engine process (engine/core_proc.run_engine_core) in an actor, with
                          the surface AsyncLLM uses of a multiprocessing.Process: sentinel, pid,
                          exitcode, is_alive, join, terminate, kill

An engine that is itself TP places its other ranks from inside its actor (worker/ray_executor.py,
a placement group of its own). The engines connect to the front end's sockets over tcp:// on this
node's address (ipc:// reaches no other machine). The actors belong to the front end's process:
Ray ends them with it (so an engine never outlives its server)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from typing import Callable

from backboard.config import EngineConfig
from backboard.engine.cpu_threads import engine_threads
from backboard.engine.transport import EngineAddresses
from backboard.worker.ray_executor import check_versions, connect_ray, versions

logger = logging.getLogger(__name__)


class _Engine:
    """The actor: where it runs, its process id, and the engine loop itself."""

    def node(self) -> tuple[str, dict[str, str]]:
        import ray

        return ray.util.get_node_ip_address(), versions()

    def pid(self) -> int:
        return os.getpid()

    def run(self, cfg: EngineConfig, addrs: EngineAddresses, log_level: str) -> None:
        from backboard.engine.core_proc import run_engine_core

        run_engine_core(cfg, addrs, log_level)


class RayEngineProcess:
    """Engine i in its actor; `sentinel` becomes readable when its loop has ended."""

    def __init__(self, actor, cfg: EngineConfig, addrs: EngineAddresses, log_level: str) -> None:
        import ray

        self.actor, self.pid = actor, ray.get(actor.pid.remote())
        self.run = actor.run.remote(cfg, addrs, log_level)
        self.exitcode: int | None = None
        self.sentinel, self._w = os.pipe()
        threading.Thread(target=self._watch, name="ray-engine-watch", daemon=True).start()

    def _result(self) -> int:
        """The exit code of the ended loop: 0 when it returned, 1 when the actor died (os._exit
        after EngineFailed, or killed)."""
        import ray

        try:
            ray.get(self.run)
            return 0
        except Exception:  # noqa: BLE001 - any failure of the actor is an unclean exit
            return 1

    def _watch(self) -> None:
        code = self._result()
        if self.exitcode is None:
            self.exitcode = code
        os.write(self._w, b"x")

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        import ray

        if ray.wait([self.run], timeout=timeout)[0]:
            self.exitcode = self._result()
            self.kill()                         # the loop has ended: free the actor's resources

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


class RayEngines:
    """The placement group of the data-parallel engines (see the module docstring)."""

    def __init__(self, cfg: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        connect_ray()
        n, self.gpu = cfg.parallel.data_parallel_size, cfg.device.startswith("cuda")
        cpus = 1 if self.gpu else engine_threads(cfg) or 1       # Ray sets OMP_NUM_THREADS to it
        self.pg = placement_group([{"GPU": 1, "CPU": cpus} if self.gpu else {"CPU": cpus}] * n, strategy="PACK")
        ray.get(self.pg.ready(), timeout=300)
        cls = ray.remote(num_cpus=cpus, num_gpus=1 if self.gpu else 0)(_Engine)
        self.actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i)).remote()
                       for i in range(n)]
        check_versions(versions(), ray.get([a.node.remote() for a in self.actors]))
        self.host = ray.util.get_node_ip_address()
        logger.info("data parallel: %d engines on Ray", n)

    def address(self) -> str:
        """Where the front end binds for an engine on Ray: tcp on this node, any free ports."""
        return f"tcp://{self.host}:0"

    def launcher(self, i: int) -> Callable[[EngineConfig, EngineAddresses, str], RayEngineProcess]:
        def launch(cfg: EngineConfig, addrs: EngineAddresses, log_level: str) -> RayEngineProcess:
            if self.gpu:                        # Ray shows each actor its own GPU as cuda:0
                cfg = replace(cfg, device="cuda:0")
            return RayEngineProcess(self.actors[i], cfg, addrs, log_level)
        return launch

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)
