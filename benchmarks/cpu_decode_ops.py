"""The fused C++ decode ops (backboard/ops/cpu/decode_ops) against their torch references, side
by side in one run, each next to its floor; then the whole decode step of a Qwen3.5-shaped
model with and without them (torch profiler: torch calls per step, time per step, time outside
the linear layers).

Floors: the larger of the bytes an op must move (recurrent state read + written, KV read,
activations) / the copy bandwidth measured here with the same thread count (a large tensor copy:
read + write bytes per second) and its FLOPs / the fp32 matmul rate measured here. The GDN and
attention cases cycle through copies of their states / KV caches larger than the last-level cache,
so every call reads from memory as in a real step (each layer has its own). The machine is shared:
numbers are noisy, run it twice; ratios measured in one run are
the figures to trust.

    python benchmarks/cpu_decode_ops.py [--preset small] [--rows 1,4,16,64] [--ctx 256]
        [--dtype bfloat16] [--threads N] [--steps 10] [--skip-step] [--skip-ops]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard.config import ModelConfig  # noqa: E402
from backboard.forward_context import set_forward_context  # noqa: E402
from backboard.models.loader import load_model, torch_dtype  # noqa: E402
from backboard.models.tiny import build_tiny_checkpoint  # noqa: E402
from backboard.ops import dispatch  # noqa: E402
from backboard.ops import norm as norm_ref  # noqa: E402
from backboard.ops.activation import silu_mul_ref  # noqa: E402
from backboard.ops.attention import paged_attention_decode_ref  # noqa: E402
from backboard.ops.cpu import decode_ops  # noqa: E402
from backboard.ops.gdn.decode import gdn_decode_ref  # noqa: E402
from backboard.worker.input_batch import BatchRequest, prepare_batch  # noqa: E402
from backboard.worker.memory import allocate_caches  # noqa: E402


# ---- timing ---------------------------------------------------------------------------------
def median_time(fn: Callable[[], object], min_time: float = 0.2, max_iters: int = 200) -> float:
    """Median seconds per call (after a warm-up call), over at least min_time of calls."""
    fn()
    ts: list[float] = []
    start = time.perf_counter()
    while len(ts) < 5 or (time.perf_counter() - start < min_time and len(ts) < max_iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def matmul_rate(n: int = 1024) -> float:
    """fp32 FLOP/s of an n x n x n torch matmul with torch's threads (the arithmetic floor)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / median_time(lambda: a @ b, min_time=0.5, max_iters=20)


def copy_bandwidth(mib: int = 256) -> float:
    """Bytes per second of a large tensor copy (read + write) with torch's threads."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), min_time=0.5, max_iters=20)
    return 2 * src.numel() * 4 / t


# ---- per-op cases ---------------------------------------------------------------------------
class OpCase:
    """One op at one shape: the torch reference, the C++ kernel, the bytes it must move and the
    floating-point operations it must do."""

    def __init__(self, name: str, rows: str, ref: Callable, ours: Callable, nbytes: int,
                 flops: int = 0) -> None:
        self.name, self.rows, self.ref, self.ours = name, rows, ref, ours
        self.nbytes, self.flops = nbytes, flops

    def floor(self, bw: float, rate: float) -> tuple[float, str]:
        """(seconds, "mem" | "flop"): the larger of bytes / bandwidth and flops / matmul rate."""
        t_mem, t_flop = self.nbytes / bw, self.flops / rate
        return (t_mem, "mem") if t_mem >= t_flop else (t_flop, "flop")


COLD_BYTES = 96 * 2**20     # larger than the last-level cache: every call streams from memory


def num_sets(set_bytes: int) -> int:
    """Copies of a working set that together exceed the cache: calls cycle through them, so each
    call reads its states / KV from memory as a real step does (each layer has its own)."""
    return max(1, -(-COLD_BYTES // max(set_bytes, 1)))


def cycling(fn: Callable[[int], object], sets: int) -> Callable[[], object]:
    calls = itertools.count()
    return lambda: fn(next(calls) % sets)


def gdn_case(cfg: ModelConfig, B: int, L: int, dt: torch.dtype) -> OpCase:
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    C = 2 * nk * dk + nv * dv
    state = nv * dk * dv * 4                               # one slot's recurrent state
    per_set = B * L                                        # verify: a slot per row
    S = num_sets(per_set * state)
    proj = torch.randn(B * L, C + nv * dv + 2 * nv).to(dt)
    w = (0.5 * torch.randn(C, K)).to(dt)
    conv = torch.randn(S * per_set + 1, K - 1, C).to(dt)
    ssm = 0.1 * torch.randn(S * per_set + 1, nv, dk, dv)
    a_log, dt_bias, nw = torch.zeros(nv), torch.zeros(nv).to(dt), torch.ones(dv).to(dt)
    src = [i * per_set + torch.arange(B) * L for i in range(S)]
    dst = [s if L == 1 else s[:, None] + torch.arange(L) for s in src]
    kw = dict(num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv, eps=1e-6)

    def run(fn, i):
        return fn(proj, w, conv, a_log, dt_bias, nw, ssm, src[i], dst[i], None, **kw)
    nbytes = B * state * (1 + L) + proj.nbytes + B * L * nv * dv * dt.itemsize
    flops = B * L * nv * dk * dv * 7          # per state element: k^T S, decay, k u^T, q^T S'
    return OpCase("gdn_decode", f"{B}x{L}", cycling(lambda i: run(gdn_decode_ref, i), S),
                  cycling(lambda i: run(decode_ops.gdn_decode, i), S), nbytes, flops)


def attention_case(cfg: ModelConfig, B: int, L: int, ctx: int, dt: torch.dtype, bs: int = 16) -> OpCase:
    nh, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per = -(-(ctx + L) // bs)
    S = num_sets(2 * B * per * bs * nkv * D * dt.itemsize)
    kc = torch.randn(S * B * per + 1, bs, nkv, D).to(dt)
    vc = torch.randn_like(kc)
    bt = [(i * B * per + torch.arange(B * per, dtype=torch.int32)).view(B, per) for i in range(S)]
    seq = torch.full((B,), ctx + L, dtype=torch.int32)
    q = torch.randn(B, L, nh, D).to(dt)

    def run(fn, i):
        return fn(q, kc, vc, bt[i], seq, ctx + L, D ** -0.5)
    nbytes = 2 * B * (ctx + L) * nkv * D * dt.itemsize + 2 * q.nbytes
    flops = 4 * B * L * nh * (ctx + L) * D    # q k^T and p v
    return OpCase(f"attention ctx {ctx}", f"{B}x{L}", cycling(lambda i: run(paged_attention_decode_ref, i), S),
                  cycling(lambda i: run(decode_ops.paged_attention_decode, i), S), nbytes, flops)


def norm_cases(cfg: ModelConfig, B: int, dt: torch.dtype) -> list[OpCase]:
    H, I = cfg.hidden_size, cfg.intermediate_size
    x, r, w = torch.randn(B, H).to(dt), torch.randn(B, H).to(dt), (0.1 * torch.randn(H)).to(dt)
    g = torch.randn(B, 2 * I).to(dt)
    return [
        OpCase("fused_add_rms_norm", str(B), lambda: norm_ref.fused_add_rms_norm_ref(x, r, w, 1e-6, True),
               lambda: decode_ops.fused_add_rms_norm(x, r, w, 1e-6, True), 4 * x.nbytes),
        OpCase("rms_norm", str(B), lambda: norm_ref.rms_norm_ref(x, w, 1e-6, True),
               lambda: decode_ops.rms_norm(x, w, 1e-6, True), 2 * x.nbytes),
        OpCase("silu_mul", str(B), lambda: silu_mul_ref(g), lambda: decode_ops.silu_mul(g),
               g.nbytes * 3 // 2),
    ]


def op_table(cfg: ModelConfig, rows: list[int], ctx: int, dt: torch.dtype, bw: float, rate: float) -> None:
    print(f"\n== per op ({dt}, ISA {decode_ops.kernels().isa()}); floor = max(bytes / {bw / 1e9:.1f} GB/s, "
          f"flops / {rate / 1e9:.0f} GFLOP/s)")
    print(f"{'op':<22}{'rows':>7}{'torch us':>11}{'C++ us':>10}{'speedup':>9}{'floor us':>10}{'bound':>6}"
          f"{'C++/floor':>11}")
    for B in rows:
        cases = [gdn_case(cfg, B, 1, dt), attention_case(cfg, B, 1, ctx, dt), *norm_cases(cfg, B, dt)]
        if B <= 16:
            cases += [gdn_case(cfg, B, 4, dt), attention_case(cfg, B, 4, ctx, dt)]   # verify, k = 3
        for c in cases:
            t_ref, t_ours = median_time(c.ref), median_time(c.ours)
            floor, bound = c.floor(bw, rate)
            print(f"{c.name:<22}{c.rows:>7}{t_ref * 1e6:11.1f}{t_ours * 1e6:10.1f}{t_ref / t_ours:8.1f}x"
                  f"{floor * 1e6:10.1f}{bound:>6}{t_ours / floor:10.1f}x", flush=True)


# ---- the whole decode step ------------------------------------------------------------------
class Stepper:
    """B requests with ctx tokens of context; run() is one decode step of all of them."""

    def __init__(self, path: str, dtype: str, B: int, ctx: int, bs: int = 16) -> None:
        self.cfg = ModelConfig.from_pretrained(path, dtype=dtype)
        self.model = load_model(self.cfg)
        per = -(-(ctx + 8) // bs)
        self.caches = allocate_caches(self.cfg, per * B + 1, bs, B, torch_dtype(self.cfg.dtype))
        blocks = [list(range(i * per, (i + 1) * per)) for i in range(B)]
        rng = np.random.default_rng(0)
        self.bs = bs
        self._run([BatchRequest(rng.integers(0, 1000, ctx), 0, blocks[i], i) for i in range(B)])
        # re-running position ctx overwrites its KV entry: every call is a genuine decode step
        self.step = [BatchRequest(np.array([int(rng.integers(0, 1000))]), ctx, blocks[i], i) for i in range(B)]

    @torch.inference_mode()
    def _run(self, reqs: list[BatchRequest]) -> torch.Tensor:
        pb = prepare_batch(reqs, self.bs)
        with set_forward_context(pb.meta, self.caches):
            h = self.model(pb.input_ids, pb.meta.positions)
        return self.model.compute_logits(h[torch.from_numpy(pb.query_start_loc[1:] - 1)])

    def run(self) -> torch.Tensor:
        return self._run(self.step)


def count_calls(stepper: Stepper) -> int:
    """Torch calls the step makes from Python: top-level torch profiler events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stepper.run()
    return sum(1 for e in prof.events() if e.cpu_parent is None)


GEMM_MODULES = ("Linear", "ColumnParallelLinear", "RowParallelLinear", "ParallelLMHead", "Int4Linear",
                "Int8Linear")


def timed_steps(stepper: Stepper, n: int) -> tuple[float, float, float]:
    """Medians over n steps of (wall seconds per step, CPU seconds per step, CPU seconds per step
    outside the GEMM modules). CPU time (all of this process's threads) does not count the time
    other processes on a shared machine take from us; with several threads it counts their
    spin-waits."""
    spent = [0.0]
    start: list[float] = []
    hooks = []
    for m in stepper.model.modules():
        if type(m).__name__ in GEMM_MODULES:
            hooks.append(m.register_forward_pre_hook(lambda *_: start.append(time.process_time())))
            hooks.append(m.register_forward_hook(
                lambda *_: spent.__setitem__(0, spent[0] + time.process_time() - start.pop())))
    wall, cpu, rest = [], [], []
    try:
        stepper.run()
        for _ in range(n):
            spent[0] = 0.0
            t, c = time.perf_counter(), time.process_time()
            stepper.run()
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            rest.append(cpu[-1] - spent[0])
    finally:
        for h in hooks:
            h.remove()
    return float(np.median(wall)), float(np.median(cpu)), float(np.median(rest))


def step_table(path: str, dtype: str, rows: list[int], ctx: int, steps: int) -> None:
    print(f"\n== decode step ({dtype}, ctx {ctx}): torch references vs C++ decode ops; GEMMs as they are")
    print(f"{'rows':>5}{'ops':>7}{'wall ms':>10}{'CPU ms':>10}{'torch calls':>13}{'CPU ms outside GEMMs':>22}")
    for B in rows:
        st = Stepper(path, dtype, B, ctx)
        for mode in ("torch", "auto"):
            with dispatch.override(mode):
                wall, cpu, rest = timed_steps(st, steps)
                calls = count_calls(st)
            label = "torch" if mode == "torch" else "C++"
            print(f"{B:>5}{label:>7}{wall * 1e3:10.2f}{cpu * 1e3:10.2f}{calls:13d}{rest * 1e3:22.2f}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="tiny-model preset (small: Qwen3.5-0.8B layer shapes)")
    ap.add_argument("--model", default=None, help="a checkpoint instead of the preset")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per row count and mode")
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or os.path.join(tempfile.gettempdir(), f"backboard-bench-{args.preset}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"building the benchmark model in {path} ...", flush=True)
        build_tiny_checkpoint(path, arch="qwen3_5_text", preset=args.preset, mtp=False)
    if decode_ops.kernels() is None:
        sys.exit("the C++ decode ops did not build (see the warning above)")
    cfg = ModelConfig.from_pretrained(path, dtype=args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"model {path}: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers; torch threads "
          f"{torch.get_num_threads()}; copy bandwidth {bw / 1e9:.1f} GB/s (read + write); fp32 matmul "
          f"{rate / 1e9:.0f} GFLOP/s")
    if not args.skip_ops:
        op_table(cfg, rows, args.ctx, torch_dtype(args.dtype), bw, rate)
    if not args.skip_step:
        step_table(path, args.dtype, rows, args.ctx, args.steps)


if __name__ == "__main__":
    main()
