"""TP = 2 with the ranks placed by Ray (a local Ray cluster, ray.init in this process): the same
greedy tokens and logprobs as multiprocessing; DP = 2 with the engines as Ray actors, each TP = 2:
every request answered once and exactly, an engine that dies stops the server; a version mismatch
between nodes stops start-up."""

from __future__ import annotations

import pytest

from backboard.config import ConfigError
from backboard.worker.ray_executor import check_versions

from .test_tensor_parallel import BASE, PROMPTS, SP, _check


def _run(path: str, **settings):
    from backboard import LLM

    with LLM(path, tensor_parallel_size=2, **{**BASE, **settings}) as llm:
        outs = llm.generate(PROMPTS, SP)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def test_ray_tp2_equals_mp(tiny_models):
    import ray  # a test dependency (pyproject's test extra): this test never skips

    path = tiny_models("qwen3_5")
    mp_out = _run(path)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray_out = _run(path, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    _check(mp_out, ray_out)


def test_ray_dp2_engines_are_actors(tiny_models, monkeypatch):
    import asyncio

    import ray

    from backboard.config import EngineConfig
    from backboard.engine.dp_client import DPAsyncLLM
    from backboard.engine.ray_engines import RayEngineProcess
    from backboard.engine.tokenizer import Tokenizer

    from .test_data_parallel import GREEDY, PROMPTS, SETTINGS, _collect

    monkeypatch.setenv("BACKBOARD_CPU_KERNELS", "0")      # the torch references start faster
    path = tiny_models("qwen3_5")
    from backboard import LLM

    prompts = PROMPTS[:8]
    with LLM(path, **SETTINGS) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    # each engine TP = 2: its other rank is placed by the engine's actor (a placement group of its own)
    cfg = EngineConfig.create(path, data_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="ray",
                              **SETTINGS)

    async def main():
        engine = DPAsyncLLM(cfg, Tokenizer(path), log_level="warning")
        await engine.start()
        try:
            await asyncio.wait_for(engine.wait_ready(), 300)
            procs = [e._proc for e in engine.engines]
            streams = [engine.add_request(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
            got = await asyncio.wait_for(asyncio.gather(*map(_collect, streams)), 300)
            ray.kill(procs[0].actor)                      # an engine that dies is the server's death
            why = await asyncio.wait_for(asyncio.shield(engine.dead), 60)
            return got, list(engine.routed), procs, [e._addrs.input for e in engine.engines], why
        finally:
            await engine.shutdown()

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)   # 2 engines x 2 ranks
    try:
        got, routed, procs, inputs, why = asyncio.run(main())
    finally:
        ray.shutdown()
    assert all(isinstance(p, RayEngineProcess) for p in procs) and len({p.pid for p in procs}) == 2
    assert all(a.startswith("tcp://") for a in inputs)    # reachable from another node
    assert [f for _, f in got] == [1] * len(prompts)      # every request answered once
    assert [t for t, _ in got] == want                    # and exactly as one engine answers it
    assert min(routed) >= 3
    assert "exited unexpectedly" in why and [p.exitcode for p in procs] == [1, 0]   # the other ended on Shutdown


def test_version_mismatch_names_the_node():
    here = {"backboard": "0.1.0", "torch": "2.13.0"}
    check_versions(here, [("10.0.0.2", dict(here))])
    with pytest.raises(ConfigError, match=r"torch 2.12.0 on node 10.0.0.2, 2.13.0 on the engine's node"):
        check_versions(here, [("10.0.0.2", {"backboard": "0.1.0", "torch": "2.12.0"})])
