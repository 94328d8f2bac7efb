"""Do the CPU scorecard's engines run the same model? Greedy tokens of one prompt, side by side.

Launches each server of the CPU preset in turn (as `backboard bench cpu-preset` would: same
checkpoint, flags, threads), asks each for the greedy continuation of one prompt through
/v1/completions (no chat template, ignore_eos), and prints how many of transformers' greedy tokens
in bf16 and in fp32 (the oracle) each engine reproduces, with the fp32 top-1 / top-2 logit gap at
each step. Random weights give flat logits: where the gap is small, bf16 rounding (which differs
between engines' kernels) may flip the argmax, after which the continuations diverge. So the check
is on the first tokens, and on where a divergence happens.

    python benchmarks/cpu_peers_agree.py [--tokens 16] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import httpx

PROMPT = ("The quick brown fox jumps over the lazy dog. In 1969, the first people landed on the "
          "Moon; the mission was called")


def reference(model_dir: str, n: int) -> dict:
    """transformers' greedy ids in bf16 and fp32, and the fp32 top-1 minus top-2 logit per step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = {"prompt_ids": ids[0].tolist()}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=n, do_sample=False, output_scores=True,
                               return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                               eos_token_id=None)
        out[str(dtype).removeprefix("torch.")] = g.sequences[0, ids.shape[1]:].tolist()
        if dtype == torch.float32:
            top2 = [s[0].float().topk(2).values for s in g.scores]
            out["gap"] = [float(t[0] - t[1]) for t in top2]
    return out


def ask(target, model: str, n: int) -> str:
    """The greedy continuation's text, through /v1/completions (each engine has its own way to
    return token ids, and none is shared by all three)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "stream": False}
    r = httpx.post(target.base_url.rstrip("/") + "/v1/completions", json=body, timeout=600,
                   trust_env=False)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def agree(text: str, ref_ids: list[int], tokenizer) -> int:
    """How many of the reference's tokens `text` reproduces: the largest k whose decoded prefix
    starts the text (a token that is part of a UTF-8 character decodes to U+FFFD alone, so the
    count is taken over all k, not up to the first miss)."""
    return max(k for k in range(len(ref_ids) + 1)
               if text.startswith(tokenizer.decode(ref_ids[:k])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--only", action="append", help="engines to ask (default: all three)")
    ap.add_argument("--model-dir", help="default: the benchmark checkpoint in the cache")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from backboard.bench.presets import prepare_cpu_preset
    from backboard.bench.sweep import running, served_model, server_info

    cfg = prepare_cpu_preset(model_dir=args.model_dir, quick=True, only=args.only)
    model_dir = cfg.tokenizer
    ref = reference(model_dir, args.tokens)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = {f"transformers {d}": tok.decode(ref[d]) for d in ("float32", "bfloat16")}
    logs = tempfile.mkdtemp(prefix="cpu-peers-agree-")
    for t in cfg.targets:
        with running(t, os.path.join(logs, f"{t.name}.log")):
            rows[t.name] = ask(t, served_model(t, server_info(t), model_dir), args.tokens)
    print(f"prompt: {len(ref['prompt_ids'])} tokens; {args.tokens} greedy tokens; server logs in "
          f"{logs}")
    print("fp32 top-1 minus top-2 logit per step: "
          + " ".join(f"{g:.2f}" for g in ref["gap"]))
    print("transformers fp32 ids: " + " ".join(map(str, ref["float32"])))
    print(f"{'engine':<20} {'= fp32':>7} {'= bf16':>7}  text")
    for name, text in rows.items():
        print(f"{name:<20} {agree(text, ref['float32'], tok):>7} "
              f"{agree(text, ref['bfloat16'], tok):>7}  {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
