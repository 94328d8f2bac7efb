"""Speculative decoding on the CPU: output tokens/s and TPOT with and without speculation at
concurrency 1, 4, 16 and 64, side by side in one run, with the mean acceptance length.

Target: the tiny hybrid with transformers' default weight scale (its next token depends mostly on
the current one, a structure a draft head can learn); draft: our int4 head, trained here by
distillation on the target's own text unless --draft points at one. Each configuration serves
the same requests (greedy, fixed output length) through LLM.generate with max_num_seqs = C.
The floor is the same engine without speculation; outputs are checked identical.

    python benchmarks/spec_decode.py [--concurrency 1,4,16,64] [--output-len 64] [--train-steps 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard import LLM, SamplingParams  # noqa: E402
from backboard.models.tiny import build_tiny_checkpoint  # noqa: E402


def run(model: str, spec, prompts, sp, C: int) -> dict:
    llm = LLM(model, max_num_seqs=C, max_model_len=512, speculative_config=spec)
    llm.generate(prompts[:2], sp)                                   # warm
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]
    st = llm.stats()
    return dict(tok_s=n / wall, tpot_ms=1e3 * float(np.mean(tpot)), tokens=[o.outputs[0].token_ids for o in outs],
                accept=st.get("spec_mean_acceptance_length"), k=getattr(llm.engine.runner.proposer, "last_k", 0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="a trained draft head (default: train one here)")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.gettempdir()
    model = args.model or os.path.join(tmp, "backboard-bench-tiny-soft")
    if not os.path.isfile(os.path.join(model, "config.json")):
        build_tiny_checkpoint(model, arch="qwen3_5", init_std=0.02)
    draft = args.draft or os.path.join(tmp, "backboard-bench-draft")
    if not os.path.isfile(os.path.join(draft, "config.json")):
        from backboard.spec_decode.train import self_generated_text, train_draft_head

        print(f"training a draft head ({args.train_steps} steps) into {draft} ...", flush=True)
        text = self_generated_text(model, 48, 128, seed=0)
        stats = train_draft_head(model, text, draft, steps=args.train_steps, seq_len=128, batch_size=8,
                                 lr=1e-2, log=lambda *a: None)
        print(f"  {stats}")
    configs = [
        ("no speculation", None),
        (f"draft_head k={args.k} adaptive", {"method": "draft_head", "draft_model": draft,
                                             "num_speculative_tokens": args.k}),
        (f"draft_head k={args.k} fixed", {"method": "draft_head", "draft_model": draft,
                                          "num_speculative_tokens": args.k, "adaptive": False}),
        (f"ngram k={args.k} adaptive", {"method": "ngram", "num_speculative_tokens": args.k}),
    ]
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print(f"target {model}; draft {draft}; greedy, {args.output_len} output tokens; floor = no speculation")
    print(f"{'C':>3} {'configuration':<28} {'out tok/s':>10} {'x floor':>8} {'TPOT ms':>9} "
          f"{'x floor':>8} {'accept len':>10} {'last k':>6}  same")
    for C in map(int, args.concurrency.split(",")):
        prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(16, 64, max(2 * C, 8))]
        base = None
        for name, spec in configs:
            r = run(model, spec, prompts, sp, C)
            base = base or r
            acc = f"{r['accept']:.2f}" if r["accept"] else "-"
            print(f"{C:>3} {name:<28} {r['tok_s']:10.1f} {r['tok_s'] / base['tok_s']:8.2f} {r['tpot_ms']:9.2f} "
                  f"{r['tpot_ms'] / base['tpot_ms']:8.2f} {acc:>10} {r['k']:>6}  {r['tokens'] == base['tokens']}",
                  flush=True)


if __name__ == "__main__":
    main()
