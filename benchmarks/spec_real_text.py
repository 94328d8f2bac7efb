"""Speculative decoding on real text: SmolLM2-135M-Instruct (the trained model PyPI gives us) as
the target, on chat prompts. Side by side in one run, floor = the same engine without speculation:

  1. a draft head distilled on text the model itself writes (greedy and T = 0.7) for the
     training prompts, with the chat template applied (`backboard draft train`'s routine);
  2. mean acceptance length at k = 1, 2, 3, 4, draft head and n-gram, greedy and T = 0.7, on
     held-out prompts (never seen in training);
  3. output tokens/s at concurrency 1, 4, 16: no speculation, draft head (adaptive k), n-gram
     (adaptive k); greedy outputs checked identical to the floor.

    python benchmarks/spec_real_text.py [--model CKPT_OR_GGUF] [--train-minutes 5] [--output-len 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard import LLM, SamplingParams  # noqa: E402

TOPICS = ["the ocean", "volcanoes", "the French Revolution", "photosynthesis", "black holes", "jazz",
          "the Roman Empire", "machine learning", "coffee", "the human heart", "bees", "chess",
          "the moon landing", "rainforests", "electricity", "the printing press", "glaciers",
          "vaccines", "the piano", "deserts", "earthquakes", "the internet", "dinosaurs", "tea",
          "the Great Wall of China", "bicycles", "honey", "lightning", "the Olympic Games", "rivers",
          "penguins", "the telescope", "bread", "the Renaissance", "solar power", "whales"]
FORMS = ["Explain {} to a ten-year-old.", "Write a short paragraph about {}.", "List five facts about {}.",
         "What are the most common misconceptions about {}?", "Write a haiku about {}.",
         "Give me three questions a student might ask about {}, with answers."]


def prompts(tok, topics: list[str]) -> list[list[int]]:
    out = []
    for i, t in enumerate(topics):
        msg = [{"role": "user", "content": FORMS[i % len(FORMS)].format(t)}]
        out.append(tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


def self_text(llm, tok, train: list[list[int]], max_tokens: int) -> str:
    params = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=i) for i, t in
              enumerate([0.0, 0.7] * len(train))]
    outs = llm.generate([{"prompt_token_ids": p} for p in train for _ in range(2)], params)
    pieces = [tok.decode(p) + o.outputs[0].text for p, o in zip([p for p in train for _ in range(2)], outs)]
    return "\n".join(pieces)


def measure(model: str, spec, reqs, sp, C: int) -> dict:
    llm = LLM(model, max_num_seqs=C, max_model_len=1024, speculative_config=spec)
    llm.generate(reqs[:2], sp)
    t = time.perf_counter()
    outs = llm.generate(reqs, sp)
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(tok_s=n / wall, accept=llm.stats().get("spec_mean_acceptance_length"),
                tokens=[list(o.outputs[0].token_ids) for o in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct from PyPI")
    ap.add_argument("--draft", default=None, help="a trained draft head (default: train one here)")
    ap.add_argument("--train-minutes", type=float, default=5.0)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16")
    args = ap.parse_args()
    from backboard.models.gguf import resolve_model_path
    from backboard.models.smollm2 import fetch_smollm2

    model = resolve_model_path(args.model or fetch_smollm2())
    llm = LLM(model, max_num_seqs=32, max_model_len=1024)
    tok = llm.get_tokenizer().hf                 # the Hugging Face tokenizer
    train, held = prompts(tok, TOPICS[:28]), prompts(tok, TOPICS[28:])
    draft = args.draft or os.path.join(tempfile.gettempdir(), "backboard-smollm2-draft")
    if not os.path.isfile(os.path.join(draft, "config.json")):
        from backboard.spec_decode.train import train_draft_head

        text = self_text(llm, tok, train, 256)
        print(f"training a draft head for {args.train_minutes} min on {len(text)} characters of the model's "
              f"own answers to {len(train)} prompts ...", flush=True)
        print("  ", train_draft_head(model, text, draft, minutes=args.train_minutes, seq_len=128,
                                     batch_size=8, log=lambda *a: None), flush=True)
    del llm
    reqs = [{"prompt_token_ids": p} for p in held]
    print(f"target {model}\nheld-out prompts: {len(held)} (chat template), {args.output_len} output tokens")
    print("mean acceptance length (tokens per verify step, drafts accepted + 1), C = 1:")
    for temp in (0.0, 0.7):
        sp = SamplingParams(temperature=temp, max_tokens=args.output_len, ignore_eos=True, seed=0)
        for method in ("draft_head", "ngram"):
            row = []
            for k in (1, 2, 3, 4):
                spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
                if method == "draft_head":
                    spec["draft_model"] = draft
                row.append(measure(model, spec, reqs, sp, 1)["accept"] or 0.0)
            print(f"  T={temp:.1f} {method:<10} " + "  ".join(f"k={k}: {a:.2f}" for k, a in zip((1, 2, 3, 4), row)),
                  flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print("decode speed (greedy), floor = no speculation:")
    for C in map(int, args.concurrency.split(",")):
        cr = (reqs * (1 + (2 * C) // len(reqs)))[:max(2 * C, len(reqs))]
        base = measure(model, None, cr, sp, C)
        for name, spec in (("draft_head k=3 adaptive", {"method": "draft_head", "draft_model": draft,
                                                         "num_speculative_tokens": 3}),
                           ("ngram k=3 adaptive", {"method": "ngram", "num_speculative_tokens": 3})):
            r = measure(model, spec, cr, sp, C)
            print(f"  C={C:<3} {name:<24} {r['tok_s']:7.1f} tok/s vs {base['tok_s']:7.1f}: "
                  f"{r['tok_s'] / base['tok_s']:.2f}x  accept {r['accept'] or 0:.2f}  "
                  f"same tokens: {r['tokens'] == base['tokens']}", flush=True)


if __name__ == "__main__":
    main()
