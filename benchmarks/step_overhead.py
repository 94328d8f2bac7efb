"""CPU time per decode step spent outside the model forward, at 1, 16, 64 and 256 running
requests: scheduling, input preparation, sampling, state updates and output processing
(detokenization). On a GPU this time is pure loss next to a ~11 ms 27B decode step; the goal is
under 1 ms at 64 requests.

The forward itself (model + LM head) is timed and subtracted; the model is the tiny test
checkpoint so that the steps are quick, but the overhead does not depend on the model's size
(except sampling, which scales with the vocabulary: --vocab-note prints it).

    python benchmarks/step_overhead.py [--model DIR] [--steps 30] [--sizes 1,16,64,256]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard import LLM, SamplingParams  # noqa: E402
from backboard.models.tiny import build_tiny_checkpoint  # noqa: E402


class Timers:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t[label] += time.perf_counter() - t0
        setattr(obj, name, timed)


def measure(path: str, n: int, steps: int, greedy: bool) -> dict[str, float]:
    llm = LLM(path, max_num_seqs=n, max_model_len=512, max_num_batched_tokens=max(2048, n * 8))
    sp = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0 if greedy else 0.8, top_p=0.95)
    for i in range(n):
        llm.add_request([1 + (i % 50), 2, 3, 4], sp)
    eng = llm.engine
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()) or \
            len(eng.scheduler.running) < n:
        llm.step()
    for _ in range(3):
        llm.step()                       # warm
    tm = Timers()
    r = eng.runner
    tm.wrap(r.model, "forward", "forward")
    tm.wrap(r.model, "compute_logits", "forward")
    tm.wrap(eng.scheduler, "schedule", "schedule")
    tm.wrap(eng.scheduler, "update_from_output", "update")
    tm.wrap(r, "_update_states", "prepare")
    tm.wrap(r, "_prepare", "prepare")
    tm.wrap(r, "_sample", "sample")
    tm.wrap(r, "_commit", "commit")
    tm.wrap(llm.outputs, "process", "detokenize")
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    total = time.perf_counter() - t0
    res = {k: v / steps * 1e3 for k, v in tm.t.items()}
    res["total"] = total / steps * 1e3
    res["overhead"] = res["total"] - res["forward"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sizes", default="1,16,64,256")
    ap.add_argument("--sampling", action="store_true", help="temperature 0.8 / top-p instead of greedy")
    args = ap.parse_args()
    path = args.model or os.path.join(tempfile.gettempdir(), "backboard-bench-tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tiny_checkpoint(path, arch="qwen3_5")
    cols = ["schedule", "prepare", "sample", "commit", "update", "detokenize", "overhead", "forward", "total"]
    print(f"model {path} ({'sampling' if args.sampling else 'greedy'}); ms per decode step, mean of {args.steps}")
    print(f"{'requests':>8} " + " ".join(f"{c:>10}" for c in cols))
    for n in map(int, args.sizes.split(",")):
        r = measure(path, n, args.steps, not args.sampling)
        print(f"{n:>8} " + " ".join(f"{r.get(c, 0.0):10.3f}" for c in cols), flush=True)
    print("overhead = total - forward (schedule + prepare + sample + commit + update + detokenize + glue)")


if __name__ == "__main__":
    main()
