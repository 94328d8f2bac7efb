"""TP = 2 with the ranks placed by Ray (a local Ray cluster, ray.init in this process): the same
greedy tokens and logprobs as multiprocessing; a version mismatch between nodes stops start-up."""

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


def test_version_mismatch_names_the_node():
    here = {"backboard": "0.1.0", "torch": "2.13.0"}
    check_versions(here, [("10.0.0.2", dict(here))])
    with pytest.raises(ConfigError, match=r"torch 2.12.0 on node 10.0.0.2, 2.13.0 on the engine's node"):
        check_versions(here, [("10.0.0.2", {"backboard": "0.1.0", "torch": "2.12.0"})])
