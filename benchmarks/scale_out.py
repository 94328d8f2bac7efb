#!/usr/bin/env python
"""Scale-out on this machine (issue 18):

  1. throughput, DP = 1 vs DP = 2: the same closed batch of greedy requests through the front
     end's engine client (AsyncLLM vs DPAsyncLLM, engine processes over ZeroMQ), output tokens/s.
     Each engine computes on cores // DP threads, so on a 2-core CPU DP = 2 splits the same two
     cores: expect no gain there (each engine's step is memory/compute bound on its one core).
  2. TP = 2 communication per step: offline LLM with tensor_parallel_size=2 (rank 0 in this
     process), decode-heavy; the collectives' seconds per step (distributed.parallel_state's
     counters, rank 0's view: waiting for the slower rank counts as communication) next to the
     bytes all-reduced / gathered / broadcast per step, and the step time against TP = 1.

    python benchmarks/scale_out.py [--model PATH] [--preset small] [--requests 32] [--max-tokens 48]

Without --model it builds a random-weight qwen3_5 of --preset (tiny / small) once in a temp cache.
On CUDA with several GPUs (--device cuda) the same script measures NCCL."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np


def build_model(preset: str) -> str:
    from backboard.models.tiny import build_tiny_checkpoint, default_cache_dir

    path = os.path.join(default_cache_dir(), f"scale-out-qwen3_5-{preset}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tiny_checkpoint(path, arch="qwen3_5", preset=preset)
    return path


def prompts(n: int, length: int) -> list[list[int]]:
    return [np.random.default_rng(i).integers(3, 900, length).tolist() for i in range(n)]


async def _throughput(model: str, dp: int, args) -> tuple[float, int, float]:
    """(output tokens/s, tokens, seconds) of the closed batch through dp engines."""
    from backboard.config import EngineConfig
    from backboard.engine.dp_client import engine_client
    from backboard.engine.tokenizer import Tokenizer
    from backboard.sampling_params import SamplingParams

    cfg = EngineConfig.create(model, data_parallel_size=dp, max_model_len=512, max_num_seqs=args.requests,
                              device=args.device)
    engine = engine_client(cfg, Tokenizer(model), log_level="warning")
    await engine.start()
    try:
        await asyncio.wait_for(engine.wait_ready(), 600)
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        await _drain([engine.add_request(p, sp, f"warm{i}") for i, p in enumerate(prompts(2, 16))])
        t0 = time.perf_counter()
        n = await _drain([engine.add_request(p, sp, f"r{i}")
                          for i, p in enumerate(prompts(args.requests, args.prompt_len))])
        dt = time.perf_counter() - t0
    finally:
        await engine.shutdown()
    return n / dt, n, dt


async def _drain(streams) -> int:
    async def one(s) -> int:
        n = 0
        async for ds in s:
            n += sum(len(c.token_ids) for d in ds for c in d.outputs)
        return n
    return sum(await asyncio.gather(*map(one, streams)))


def tp_comm(model: str, tp: int, args) -> dict[str, float]:
    """Per step: seconds, collective seconds and bytes (rank 0), for a decode-heavy batch."""
    from backboard import LLM, SamplingParams
    from backboard.distributed import parallel_state as ps

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(model, tensor_parallel_size=tp, max_model_len=512, max_num_seqs=args.requests,
             device=args.device) as llm:
        llm.generate(prompts(2, 16), sp, use_tqdm=False)                       # warm up
        before, steps0, t0 = ps.CommStats(**vars(ps.comm_stats)), llm.engine.num_steps, time.perf_counter()
        llm.generate(prompts(args.requests, args.prompt_len), sp, use_tqdm=False)
        dt, steps = time.perf_counter() - t0, llm.engine.num_steps - steps0
    after = ps.comm_stats
    per = {k: (getattr(after, k) - getattr(before, k)) / steps for k in vars(after)}
    return {"steps": steps, "step_ms": 1000 * dt / steps, "comm_ms": 1000 * per["time_s"],
            "calls": per["calls"], "all_reduce_kib": per["all_reduce_bytes"] / 1024,
            "all_gather_kib": per["all_gather_bytes"] / 1024, "broadcast_kib": per["broadcast_bytes"] / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small", choices=("tiny", "small"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    model = args.model or build_model(args.preset)
    print(f"model {model}; {args.requests} requests x ({args.prompt_len} prompt + {args.max_tokens} output) "
          f"tokens, greedy; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    print("\n== throughput through the front end's engine client ==")
    for dp in (1, 2):
        tps, n, dt = asyncio.run(_throughput(model, dp, args))
        print(f"DP={dp}: {n} output tokens in {dt:.2f} s = {tps:.1f} tok/s")
    print("\n== tensor parallelism: per step (rank 0) ==")
    for tp in (1, 2):
        r = tp_comm(model, tp, args)
        print(f"TP={tp}: {r['steps']:.0f} steps, {r['step_ms']:.2f} ms/step, communication {r['comm_ms']:.2f} ms/step "
              f"({r['calls']:.1f} collectives); all-reduced {r['all_reduce_kib']:.1f} KiB, gathered "
              f"{r['all_gather_kib']:.1f} KiB, broadcast {r['broadcast_kib']:.1f} KiB per step")


if __name__ == "__main__":
    main()
