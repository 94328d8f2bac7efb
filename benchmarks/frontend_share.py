#!/usr/bin/env python
"""Does the HTTP front end steal CPU from the step? Serves a checkpoint on the CPU (the engine
computes on every core by default, the front end keeps one torch thread), streams requests at
each concurrency, and reads both processes' CPU time (/proc/PID/stat, user + system) and thread
counts over the same window:

    front end CPU s / engine CPU s    the share the front end takes (HTTP, JSON, tokenization,
                                      detokenization, SSE, the socket hop)
    front end CPU ms per step         next to the engine's step time from /metrics

    python benchmarks/frontend_share.py [--model PATH] [--dtype bfloat16] [--concurrency 1 16]
        [--server-arg=--cpu-threads=1]

Without --model it serves a tiny qwen3_5 (the front end's share is largest where the step is
cheapest: an upper bound for real checkpoints). On a machine shared with other jobs the shares are
noisy; they are a ratio of CPU time, not of wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from frontend_overhead import engine_counters, make_prompts, run_phase, start_server, wait_idle  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK     # utime, stime (fields 14, 15)


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln.split()[1] for ln in f if ln.startswith("Threads:")))


def engine_pid(front_pid: int) -> int:
    """The engine process: the front end's child running the model (the largest resident one)."""
    kids = [int(p) for p in open(f"/proc/{front_pid}/task/{front_pid}/children").read().split()]
    if not kids:
        raise SystemExit("no engine process under the server")

    def rss(pid: int) -> int:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1])

    return max(kids, key=rss)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a tiny qwen3_5 in a temp dir)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency point")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for `backboard serve`")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from backboard.models.tiny import build_tiny_checkpoint

        model = build_tiny_checkpoint(os.path.join(tempfile.mkdtemp(prefix="fe-share-"), "m"), arch="qwen3_5")
    proc, url = start_server(model, max(args.concurrency), 4 * args.input_len + args.max_tokens + 64,
                             ["--device", "cpu", "--dtype", args.dtype, *args.server_arg])
    try:
        eng = engine_pid(proc.pid)
        print(f"{os.cpu_count()} CPUs (affinity {len(os.sched_getaffinity(0))}); load average "
              f"{os.getloadavg()[0]:.1f}; front end pid {proc.pid} ({threads(proc.pid)} threads), engine pid "
              f"{eng} ({threads(eng)} threads); {args.dtype}; flags {args.server_arg or 'default'}")
        asyncio.run(run_phase(url, None, make_prompts(model, 4, args.input_len, 1), 4, args.max_tokens, None))
        for c in args.concurrency:
            prompts = make_prompts(model, max(args.requests, c), args.input_len, seed=c)
            wait_idle(url)
            s0, f0, e0 = engine_counters(url), cpu_seconds(proc.pid), cpu_seconds(eng)
            _, wall = asyncio.run(run_phase(url, None, prompts, c, args.max_tokens, None))
            wait_idle(url)
            s1, f1, e1 = engine_counters(url), cpu_seconds(proc.pid), cpu_seconds(eng)
            steps = max(1.0, s1[1] - s0[1])
            fe, en = f1 - f0, e1 - e0
            print(f"C={c:<3} {len(prompts)} requests in {wall:6.2f} s: front end {fe:6.2f} CPU s, engine "
                  f"{en:6.2f} CPU s -> front end share {fe / max(en, 1e-9):6.1%}; per step: front end "
                  f"{1e3 * fe / steps:6.2f} CPU ms, engine step {1e3 * (s1[0] - s0[0]) / steps:6.2f} ms "
                  f"({int(steps)} steps)")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
