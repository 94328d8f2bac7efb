#!/usr/bin/env python
"""What random sampling costs a decode step, measured against greedy decoding of the same requests
(the floor: a draw should cost next to nothing beside the forward), side by side in one run, and
the sampler alone on one [R, V] distribution: at temperature 1 (on the CPU softmax and draw fused in
one C++ op), Sampler.draw of given probabilities (the C++ inverse CDF), and the exponential race it
replaced there (torch's exponential_ over the whole vocabulary).

    python benchmarks/sampling_cost.py [--model DIR] [--concurrency 1 16] [--output-len 64]

Default model: the CPU benchmark checkpoint (real 248K vocabulary) when cached, else the tiny
hybrid. Prints tokens/s per (concurrency, temperature) and sampled / greedy.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard import LLM, SamplingParams  # noqa: E402
from backboard.models.tiny import build_tiny_checkpoint  # noqa: E402
from backboard.ops.sampling import exponential_race  # noqa: E402
from backboard.sample.metadata import SamplingMetadata  # noqa: E402
from backboard.sample.sampler import Sampler  # noqa: E402

BENCH = os.path.expanduser("~/.cache/backboard/models/qwen3_5-cpu-bench-v1-bfloat16")


def decode_tps(llm: LLM, C: int, temperature: float, output_len: int, rng) -> float:
    sp = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True)
    prompts = [{"prompt_token_ids": rng.integers(1000, 20000, 32).tolist()} for _ in range(C)]
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def draw_ms(R: int, V: int, reps: int = 10) -> tuple[float, float, float]:
    """ms for one [R, V] distribution: the whole Sampler at temperature 1 (softmax and draw fused),
    Sampler.draw of given probabilities, and the exponential race they replaced on the CPU."""
    logits = torch.randn(R, V) * 2
    probs = torch.softmax(logits, -1)
    md = SamplingMetadata(temperature=torch.ones(R), all_greedy=False)
    s = Sampler(0)
    out = []
    for f in (lambda: s(logits, md), lambda: s.draw(probs, md),
              lambda: exponential_race(probs, torch.empty(R, V).exponential_())):
        f()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        out.append(1e3 * (time.perf_counter() - t) / reps)
    return out[0], out[1], out[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="greedy / sampled pairs per point (median)")
    a = ap.parse_args()
    model = a.model or (BENCH if os.path.isdir(BENCH) else None)
    if model is None:
        model = build_tiny_checkpoint(tempfile.mkdtemp(), "qwen3_5")
    llm = LLM(model, dtype=a.dtype, max_num_seqs=max(a.concurrency), max_model_len=512,
              enable_prefix_caching=False)
    V = llm.engine.runner.model.lm_head.weight.shape[0]
    rng = np.random.default_rng(0)
    decode_tps(llm, max(a.concurrency), 0.0, 8, rng)                  # warm-up
    print(f"model {model}; {torch.get_num_threads()} threads; output {a.output_len} tokens, ignore_eos")
    print("C  greedy tok/s  T=1.0 tok/s  sampled/greedy")
    for C in a.concurrency:
        pairs = [(decode_tps(llm, C, 0.0, a.output_len, rng), decode_tps(llm, C, 1.0, a.output_len, rng))
                 for _ in range(a.rounds)]
        g, s = np.median([p[0] for p in pairs]), np.median([p[1] for p in pairs])
        print(f"{C:<3}{g:13.1f}{s:13.1f}{s / g:15.2f}")
    for R in (1, 16):
        whole, d, race = draw_ms(R, V)
        print(f"{R} x {V}: Sampler at T = 1 (fused) {whole:.3f} ms; Sampler.draw of probs {d:.3f} ms; "
              f"exponential race {race:.3f} ms ({race / d:.0f}x the draw)")


if __name__ == "__main__":
    main()
