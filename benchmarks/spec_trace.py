"""Where a speculating engine's time goes, step by step, beside the same engine without
speculation: the run split by step kind, so that a speed-up or loss at some concurrency can be put
on the steps that make it.

Both engines serve the same requests (benchmarks/spec_decode.py's held-out chat prompts, 10 C of
them, output lengths drawn as InferenceX draws them, greedy, ignore_eos) at max_num_seqs C. Every
EngineCore.step is timed from its start to the next one's (scheduler, forward, sampling, drafting,
output) and put in one of:

    prefill   steps with prompt rows (a new request's prefill, beside any decode rows)
    decode    steps of decode rows only, at a full batch (C requests), by k (drafts verified per
              request: k0 = none)
    partial   decode-only steps with fewer than C requests (the tail of the run)

and each line gives the steps, their seconds, ms per step, output tokens per step and tokens per ms.

    python benchmarks/spec_trace.py --model smollm2 --draft DIR [--method draft_head|ngram]
        [--concurrency 16] [--k 3] [--fixed-k K] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard import LLM  # noqa: E402
from benchmarks.spec_decode import held_out_asks, speed_params  # noqa: E402


class StepTrace:
    """Wraps an engine's EngineCore.step: (kind, seconds, output tokens) per step, the seconds of a
    step running from its start to the next step's start."""

    def __init__(self, llm: LLM, C: int) -> None:
        self.core, self.C = llm.engine, C
        self.rows: list[tuple[str, float, int]] = []
        self._last: tuple[float, str, int] | None = None
        self._kind_now: str | None = None
        schedule, step = self.core.scheduler.schedule, self.core.step
        self.core.scheduler.schedule = lambda: self._scheduled(schedule())
        self.core.step = lambda: self._step(step)

    def _scheduled(self, so):
        self._kind_now = self._kind(so) if so.total_num_scheduled_tokens else None
        return so

    def _kind(self, so) -> str:
        n = len(so.num_scheduled_tokens)
        if any(q > 1 + len(so.spec_decode_tokens.get(r, ())) for r, q in so.num_scheduled_tokens.items()):
            return "prefill"
        if n < self.C:
            return "partial"
        return f"decode k{max((len(d) for d in so.spec_decode_tokens.values()), default=0)}"

    def _step(self, inner):
        t = time.perf_counter()
        if self._last is not None:
            self.rows.append((self._last[1], t - self._last[0], self._last[2]))
        self._kind_now = None
        outs = inner()
        kind = self._kind_now
        self._last = (t, kind, sum(len(o.new_token_ids) for o in outs)) if kind else None
        return outs

    def split(self) -> dict[str, tuple[int, float, int]]:
        """kind -> (steps, seconds, output tokens)."""
        out: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
        for kind, s, n in self.rows:
            o = out[kind]
            o[0], o[1], o[2] = o[0] + 1, o[1] + s, o[2] + n
        return {k: tuple(v) for k, v in sorted(out.items())}


def run(model: str, spec, reqs, sp, C: int) -> tuple[float, float, dict]:
    """One engine after a warm-up: (wall seconds, output tokens/s, the step split)."""
    llm = LLM(model, max_num_seqs=C, max_model_len=1024, speculative_config=spec)
    llm.generate(reqs[:2], sp[:2])
    trace = StepTrace(llm, C)
    t = time.perf_counter()
    outs = llm.generate(reqs, sp)
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return wall, n / wall, trace.split()


def show(name: str, wall: float, tok_s: float, split: dict) -> None:
    parts = [f"{k} {n} {s:.2f} s ({1e3 * s / n:.1f} ms, {tok / n:.1f} tok, {tok / (1e3 * s):.3f} tok/ms)"
             for k, (n, s, tok) in split.items() if n]
    print(f"  {name:<24} wall {wall:6.2f} s {tok_s:7.1f} tok/s | " + " | ".join(parts), flush=True)


def main() -> None:
    from backboard.engine.tokenizer import Tokenizer
    from backboard.models.gguf import resolve_model_path
    from backboard.models.smollm2 import fetch_smollm2
    from backboard.spec_decode.corpus import chat_prompt_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default=None, help="draft head folder (method draft_head)")
    ap.add_argument("--method", default="draft_head", choices=["draft_head", "ngram"])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--fixed-k", type=int, default=None, help="speculate with this k every step (no adaptive k)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.method == "draft_head" and not args.draft:
        ap.error("--method draft_head needs --draft DIR (a trained head: backboard draft train)")
    model = resolve_model_path(fetch_smollm2() if args.model == "smollm2" else args.model)
    C = args.concurrency
    n = max(10 * C, 16)
    held = chat_prompt_ids(Tokenizer(model).hf, held_out_asks(48))
    reqs = [{"prompt_token_ids": p} for p in (held * (1 + n // len(held)))[:n]]
    sp = speed_params(args, n)
    spec = {"method": args.method, "num_speculative_tokens": args.fixed_k or args.k,
            "adaptive": args.fixed_k is None}
    if args.method == "draft_head":
        spec["draft_model"] = args.draft
    label = f"{args.method} k={args.fixed_k} fixed" if args.fixed_k else f"{args.method} k={args.k} adaptive"
    print(f"{model}, C={C}, {n} requests, output lengths in [{args.range_ratio} L, L], L = {args.output_len}")
    for i in range(args.repeats):
        pair = [("none", None), (label, spec)]
        for name, s in (pair if i % 2 == 0 else pair[::-1]):
            show(name, *run(model, s, reqs, sp, C))


if __name__ == "__main__":
    main()
