"""Prefix caching on the CPU: TTFT, throughput and hit rate with the cache on and off, side by side
in one run, with and without speculation (n-gram; the benchmark checkpoint has no MTP head).

Workloads (token ids, framed as ChatML turns; random text ids, so no answer repeats the history):
- multi-turn chat: S conversations of T turns. Every turn resends the whole history (a system
  prompt, the earlier user messages and answers) plus a new user message; the conversations take
  turns one request at a time, so TTFT is the prefill of whatever the cache does not hold.
  Hit rate = cached tokens / resent tokens (the previous turn's prompt and answer).
- shared system prompt: N requests, one long system prompt and a short distinct question each,
  arriving in waves of C at once (each wave waits for the one before).
  Hit rate = cached tokens / system-prompt tokens of every request after the first wave.
The floor is the same engine with --no-enable-prefix-caching; greedy outputs are checked equal.

    python benchmarks/prefix_cache.py [--model DIR | --model tiny] [--turns 6] [--sessions 3]

Default model: the CPU benchmark checkpoint (`backboard bench checkpoint`: an 8-layer Qwen3.5
hybrid with the real 248K vocabulary; built and cached on first use).
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

TEXT_IDS = 150_000          # random "text" below the special tokens of the real vocabulary


def chatml(rng, vocab: int):
    """(system prompt, user message, assistant header, end of turn) token builders."""
    hi = min(TEXT_IDS, vocab)
    start, end, nl = rng.integers(0, hi, 3).tolist()          # <|im_start|>, <|im_end|>, \n stand-ins
    role = {r: rng.integers(0, hi, 1).tolist() for r in ("system", "user", "assistant")}

    def turn(r: str, n: int) -> list[int]:
        return [start, *role[r], nl, *rng.integers(0, hi, n).tolist(), end, nl]

    return turn, [start, *role["assistant"], nl], [end, nl]


def make_llm(model: str, cache: bool, spec, max_len: int, seqs: int) -> LLM:
    return LLM(model, max_model_len=max_len, max_num_seqs=seqs, enable_prefix_caching=cache,
               speculative_config=spec)


def ttft(o) -> float:
    return o.metrics.first_token_time - o.metrics.arrival_time


def multi_turn(llm: LLM, args, vocab: int) -> dict:
    rng = np.random.default_rng(1)
    turn, header, eot = chatml(rng, vocab)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    history = [turn("system", args.system_len) for _ in range(args.sessions)]
    per_turn, cached, resent, tokens, n_out = [], 0, 0, [], 0
    t0 = time.perf_counter()
    for t in range(args.turns):
        row = []
        for s in range(args.sessions):
            prompt = history[s] + turn("user", args.user_len) + header
            o = llm.generate([prompt], sp)[0]
            answer = o.outputs[0].token_ids
            row.append(ttft(o))
            if t > 0:
                cached, resent = cached + o.num_cached_tokens, resent + len(history[s])
            history[s] = prompt + answer + eot
            tokens.append(answer)
            n_out += len(answer)
        per_turn.append(row)
    wall = time.perf_counter() - t0
    flat = [x for row in per_turn for x in row]
    return {"ttft_med": float(np.median(flat)), "ttft_turn": [float(np.median(r)) for r in per_turn],
            "tok_s": n_out / wall, "wall": wall, "hit": cached / max(resent, 1), "tokens": tokens,
            "prompt_len": len(history[0])}


def shared_system(llm: LLM, args, vocab: int) -> dict:
    rng = np.random.default_rng(2)
    turn, header, _ = chatml(rng, vocab)
    system = turn("system", args.shared_len)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [system + turn("user", args.user_len) + header for _ in range(args.requests)]
    ttfts, tokens, cached, n_out = [], [], 0, 0
    t0 = time.perf_counter()
    for w in range(0, len(prompts), args.wave):
        for o in llm.generate(prompts[w:w + args.wave], sp):
            ttfts.append(ttft(o))
            tokens.append(o.outputs[0].token_ids)
            n_out += len(o.outputs[0].token_ids)
            cached += o.num_cached_tokens if w else 0
    wall = time.perf_counter() - t0
    later = max(1, len(prompts) - args.wave) * len(system)
    return {"ttft_med": float(np.median(ttfts)), "tok_s": n_out / wall, "wall": wall,
            "hit": cached / later, "tokens": tokens, "prompt_len": len(prompts[0])}


def model_path(arg: str | None) -> str:
    if arg == "tiny":
        from backboard.models.tiny import build_tiny_checkpoint

        path = os.path.join(tempfile.gettempdir(), "backboard-bench-tiny-hybrid")
        if not os.path.isfile(os.path.join(path, "config.json")):
            build_tiny_checkpoint(path, arch="qwen3_5")
        return path
    if arg:
        return arg
    from backboard.bench.checkpoint import ensure_bench_checkpoint

    return ensure_bench_checkpoint()


def report(name: str, results: dict, per_turn: bool) -> None:
    print(f"\n== {name} (prompt up to {next(iter(results.values()))['prompt_len']} tokens) ==")
    print(f"{'speculation':<12} {'cache':<5} {'TTFT med ms':>11} {'off/on':>7} {'out tok/s':>10} "
          f"{'on/off':>7} {'wall s':>7} {'hit rate':>9}  same tokens as off")
    for spec in ("none", "ngram"):
        off, on = results[(spec, False)], results[(spec, True)]
        for cache, r in (("off", off), ("on", on)):
            ratio = f"{off['ttft_med'] / r['ttft_med']:7.2f}"
            speed = f"{r['tok_s'] / off['tok_s']:7.2f}"
            hit = f"{100 * r['hit']:8.1f}%" if cache == "on" else f"{'-':>9}"
            print(f"{spec:<12} {cache:<5} {1e3 * r['ttft_med']:11.1f} {ratio} {r['tok_s']:10.1f} {speed} "
                  f"{r['wall']:7.1f} {hit}  {r['tokens'] == results[('none', False)]['tokens']}")
    if per_turn:
        print("median TTFT per turn, ms (off / on = ratio):")
        for spec in ("none", "ngram"):
            off, on = results[(spec, False)]["ttft_turn"], results[(spec, True)]["ttft_turn"]
            cells = "  ".join(f"{1e3 * a:.0f}/{1e3 * b:.0f}={a / b:.1f}x" for a, b in zip(off, on))
            print(f"  {spec:<6} {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint folder, or 'tiny' (default: the bench checkpoint)")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=256, help="multi-turn: system prompt tokens")
    ap.add_argument("--user-len", type=int, default=64, help="tokens of each user message")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--shared-len", type=int, default=1024, help="shared system prompt tokens")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--wave", type=int, default=4, help="shared system prompt: requests arriving together")
    ap.add_argument("--k", type=int, default=3, help="n-gram draft tokens")
    args = ap.parse_args()
    model = model_path(args.model)
    max_len = 2048 if args.model != "tiny" else 4096
    specs = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": False}}
    print(f"model {model}; greedy, {args.output_len} output tokens; floor = the same engine, prefix cache off")
    for name, fn, per_turn, seqs in (("multi-turn chat", multi_turn, True, 4),
                                     ("shared system prompt", shared_system, False, args.wave)):
        results = {}
        for spec, sc in specs.items():
            for cache in (False, True):
                llm = make_llm(model, cache, sc, max_len, seqs)
                if cache and spec == "none":
                    print(llm.engine.describe())
                llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2))          # warm
                llm.reset_prefix_cache()
                results[(spec, cache)] = fn(llm, args, llm.config.model.vocab_size)
                del llm
        report(name, results, per_turn)


if __name__ == "__main__":
    main()
