"""Data parallelism: two engine processes behind one front-end client (DPAsyncLLM). 32
concurrent greedy requests are each answered once and exactly as by one engine; requests are
spread over both engines; an abort reaches the engine holding the request; /metrics shows each
engine and the total."""

from __future__ import annotations

import asyncio

import numpy as np

from backboard.config import EngineConfig
from backboard.core.outputs import SchedulerStats
from backboard.engine import messages as M
from backboard.engine.dp_client import DPAsyncLLM, combine_stats, engine_address
from backboard.engine.tokenizer import Tokenizer
from backboard.sampling_params import SamplingParams
from backboard.server.metrics import ServerMetrics

PROMPTS = [np.random.default_rng(i).integers(3, 1000, 5 + i % 13).tolist() for i in range(32)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SETTINGS = {"max_model_len": 128, "max_num_seqs": 8, "cpu_threads": 1}


async def _collect(stream) -> tuple[list[int], int]:
    """(tokens, finished deltas)."""
    toks, finished = [], 0
    async for deltas in stream:
        for d in deltas:
            finished += d.finished
            toks += [t for c in d.outputs for t in c.token_ids]
    return toks, finished


def test_dp2_answers_32_concurrent_requests_once_and_exactly(tiny_models, monkeypatch):
    monkeypatch.setenv("BACKBOARD_CPU_KERNELS", "0")      # both sides on the torch references; faster start
    from backboard import LLM

    model = tiny_models("qwen3_5")
    with LLM(model, **SETTINGS) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    cfg = EngineConfig.create(model, data_parallel_size=2, **SETTINGS)

    async def main():
        engine = DPAsyncLLM(cfg, Tokenizer(model), log_level="warning")
        await engine.start()
        try:
            await asyncio.wait_for(engine.wait_ready(), 300)
            streams = [engine.add_request(p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)]
            got = await asyncio.wait_for(asyncio.gather(*map(_collect, streams)), 300)
            long = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True), "long")
            await long.get()                              # it is running in one engine
            holder = engine.owner["long"]
            engine.abort("long")
            await asyncio.sleep(0.5)
            return got, list(engine.routed), holder.num_unfinished, dict(engine.owner), engine.num_unfinished
        finally:
            await engine.shutdown()

    got, routed, holder_left, owner, left = asyncio.run(main())
    assert [f for _, f in got] == [1] * 32                # every request answered once
    assert [t for t, _ in got] == want                    # and exactly as one engine answers it
    assert min(routed) >= 8 and sum(routed) == 33        # least-loaded routing uses both engines
    assert holder_left == 0 and owner == {} and left == 0


def test_combined_stats_and_metrics_per_engine():
    a = M.EngineStats(SchedulerStats(num_running=2, kv_cache_usage=0.5, spec_accepted_per_position=[1, 2]), 10)
    b = M.EngineStats(SchedulerStats(num_running=1, kv_cache_usage=0.1, spec_accepted_per_position=[3]), 5)
    t = combine_stats([a, b])
    assert t.scheduler.num_running == 3 and t.num_steps == 15
    assert abs(t.scheduler.kv_cache_usage - 0.3) < 1e-9 and t.scheduler.spec_accepted_per_position == [4, 2]
    m = ServerMetrics("tiny")
    m.add_engines(2)
    assert 'backboard:engine_num_requests_running{engine="0",model_name="tiny"} 0.0' in m.render().decode()
    m.update_engine_replica(1, b)
    m.update_engine(t)
    text = m.render().decode()
    assert 'backboard:engine_num_requests_running{engine="1",model_name="tiny"} 1.0' in text
    assert 'backboard:num_requests_running{model_name="tiny"} 3.0' in text


def test_engine_addresses():
    assert engine_address(None, 1) is None
    assert engine_address("tcp://127.0.0.1:5000", 1) == "tcp://127.0.0.1:5002"
    assert engine_address("tcp://127.0.0.1:0", 1) == "tcp://127.0.0.1:0"
    assert engine_address("ipc:///tmp/x", 1) == "ipc:///tmp/x/engine-1"
