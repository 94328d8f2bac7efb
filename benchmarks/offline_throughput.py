"""Output tokens/s of LLM.generate against transformers' batched `generate` on the same model and
requests (greedy, fixed output lengths), side by side in one run, as a ratio. The floor is
transformers' own batched generate (left-padded, its dynamic cache) on this machine.

    python benchmarks/offline_throughput.py [--model DIR] [--num 32] [--input-len 128] [--output-len 64]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: the tiny hybrid)")
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    import transformers as tf

    path = args.model or os.path.join(tempfile.gettempdir(), "backboard-bench-tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tiny_checkpoint(path, arch="qwen3_5_text")
    rng = np.random.default_rng(0)
    lens = rng.integers(int(args.input_len * 0.8), args.input_len + 1, args.num)
    prompts = [rng.integers(0, 900, int(n)).tolist() for n in lens]

    llm = LLM(path, dtype=args.dtype, max_num_seqs=args.num, max_model_len=args.input_len + args.output_len + 8)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], sp)                                  # warm
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    t_ours = time.perf_counter() - t
    n_ours = sum(len(o.outputs[0].token_ids) for o in outs)

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    L = max(lens)
    ids = torch.zeros(args.num, L, dtype=torch.long)
    mask = torch.zeros(args.num, L, dtype=torch.long)
    for i, p in enumerate(prompts):                                # left padding
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    with torch.inference_mode():
        hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=2, do_sample=False, pad_token_id=0)
        t = time.perf_counter()
        g = hf.generate(ids, attention_mask=mask, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                        do_sample=False, pad_token_id=0, eos_token_id=None)
        t_hf = time.perf_counter() - t
    n_hf = (g.shape[1] - L) * args.num
    same = sum(o.outputs[0].token_ids == g[i, L:].tolist() for i, o in enumerate(outs))
    print(f"model {path}, {args.num} requests, input ~{args.input_len}, output {args.output_len}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"backboard LLM.generate : {n_ours / t_ours:9.1f} output tok/s ({t_ours:.2f} s)")
    print(f"transformers generate  : {n_hf / t_hf:9.1f} output tok/s ({t_hf:.2f} s)  (floor)")
    print(f"ratio                  : {(n_ours / t_ours) / (n_hf / t_hf):9.2f}x")
    print(f"identical greedy outputs: {same}/{args.num} (left padding can shift transformers' numerics)")


if __name__ == "__main__":
    main()
