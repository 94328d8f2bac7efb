"""The CPU GEMMs (ops/cpu/gemm.cpp) and the whole decode step against their floors, side by side.

Floors, measured in the same run with the same threads:
  bandwidth  a streaming read of 512 MiB (our C++ bf16 sum, and torch's fp32 sum: the faster)
  rate       torch's matmul at 512 x 2048 x 2048 in fp32 and in bf16 (the faster: native bf16
             where the CPU has it; on AMD, MKL's fp32 GEMM runs its AVX2 code)
  a kernel   max(weight bytes / bandwidth, 2 M N K / rate); prefill rows also against the fp32
             rate alone (the TTFT target)
  a step     max(bytes / bandwidth, FLOPs / rate) where bytes = every weight once + per request
             the GDN state read and written + the KV read, and FLOPs = 2 x rows x linear weights;
             its bandwidth is probed again just before and just after the step is timed (the mean
             of the two), since some VMs move between memory rates within minutes (a Zen 5 VM read
             ~35 or ~90 GB/s); steps whose two probes differ by more than STATE_CHANGE are marked

Sections: each linear shape of the model at 1, 4, 16, 64 rows (+ prefill 256, 512) for ours
(dispatch.linear: what the layers run), torch bf16 and torch fp32; int8 / int4 (the draft head's
formats); greedy tokens from the LM head at 1, 2, 4 rows, logits + argmax against the INT8
screen (sample/greedy_screen.py); causal prefill attention of one request (dispatch.paged_attention_prefill: the C++
flash form on AVX512-BF16) against torch's bf16 SDPA and the FLOP floor; the decode step of the
model at 1, 4, 16, 64 requests in bf16 and fp32, and the two taken in turn (their ratio).

    python benchmarks/cpu_kernels.py [--threads N] [--model CKPT] [--quick]

The default model has the scorecard checkpoint's shapes (hidden 512, 8 layers: 6 GDN + 2
attention, vocabulary 248320, tied embeddings; random weights; built once into the cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard.ops import dispatch, quant  # noqa: E402
from backboard.ops.cpu import build, gemm  # noqa: E402
from backboard.worker.input_batch import BatchRequest  # noqa: E402

BENCH_SHAPE = dict(  # the scorecard checkpoint (issue 11): 325 MB of bf16 weights per decode step
    vocab_size=248320, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
    full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
    attn_output_gate=True, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768,
    initializer_range=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def wall_clock() -> float:
    return time.perf_counter()


def cpu_clock() -> float:
    """This process's CPU time per torch thread: on a machine shared with other jobs (where the
    scheduler hands this process a fraction of each core) an estimate of the idle-machine wall
    time; exact with one thread, an upper bound with more (spin-waits count)."""
    return time.process_time() / torch.get_num_threads()


CLOCK = wall_clock


def timed(fn, reps: int = 5, budget_s: float = 3.0) -> float:
    """Best time of `reps` calls after a warm-up; one call when a call takes over budget_s / 2."""
    t = CLOCK()
    fn()
    first = CLOCK() - t
    best = first
    for _ in range(reps if first < budget_s / 2 else 0):
        t = CLOCK()
        fn()
        best = min(best, CLOCK() - t)
    return best


# ---- floors ------------------------------------------------------------------------------------
def read_bandwidth() -> float:
    """Bytes per second of a streaming read of 512 MiB (the faster of two probes)."""
    mod = gemm.module()
    a, af = torch.ones(256 << 20, dtype=torch.bfloat16), torch.ones(128 << 20)
    ours = a.numel() * 2 / timed(lambda: mod.sum_bf16(a)) if mod is not None else 0.0
    return max(ours, af.numel() * 4 / timed(af.sum))


def matmul_rates() -> tuple[float, float]:
    """FLOP/s of torch's fp32 and bf16 matmul at 512 x 2048 x 2048."""
    x, w = torch.randn(512, 2048), torch.randn(2048, 2048)
    flops = 2 * 512 * 2048 * 2048
    fp32 = flops / timed(lambda: F.linear(x, w))
    bf16 = flops / timed(lambda: F.linear(x.bfloat16(), w.bfloat16()), reps=2)
    return fp32, bf16


class Floors:
    def __init__(self) -> None:
        self.bw = read_bandwidth()
        self.fp32, self.bf16 = matmul_rates()
        self.rate = max(self.fp32, self.bf16)

    def __str__(self) -> str:
        return (f"read bandwidth {self.bw / 1e9:.1f} GB/s; matmul fp32 {self.fp32 / 1e9:.0f} GFLOP/s, "
                f"bf16 {self.bf16 / 1e9:.0f} GFLOP/s (floors use {self.rate / 1e9:.0f})")

    def of(self, nbytes: float, flops: float, bw: float | None = None) -> float:
        return max(nbytes / (bw or self.bw), flops / self.rate)


STATE_CHANGE = 1.25   # probes around a step further apart than this: the memory rate moved while it ran


def timed_with_bandwidth(fn) -> tuple[float, float, float]:
    """(fn's best time, the read bandwidth probed just before it, just after it)."""
    before = read_bandwidth()
    t = timed(fn, reps=5)
    return t, before, read_bandwidth()


# ---- kernels -----------------------------------------------------------------------------------
def linear_shapes(model) -> list[tuple[str, int, int]]:
    """(name, N, K) of every distinct linear weight of the model, LM head last."""
    from backboard.layers.linear import Linear

    seen: dict[tuple[int, int], str] = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            seen.setdefault(tuple(m.weight.shape), name.split("layers.")[-1].split(".", 1)[-1])
    V, H = model.lm_head.weight.shape
    return [(n, N, K) for (N, K), n in seen.items()] + [("lm_head", V, H)]


def bench_linear(fl: Floors, name: str, N: int, K: int, rows: list[int], prefill: list[int]) -> None:
    w = torch.randn(N, K).bfloat16()
    wf = w.float()
    gemm.pack_widened([w], dispatch.available_memory())    # as the engine does (its decode rows' copy)
    for M in rows + prefill:
        x = torch.randn(M, K).bfloat16()
        flops = 2 * M * N * K
        ours = timed(lambda: dispatch.linear(x, w))
        tb = timed(lambda: F.linear(x, w), reps=2)
        tf = timed(lambda: F.linear(x.float(), wf), reps=2)
        floor = fl.of(N * K * 2, flops)
        extra = (f"  fp32-rate floor {flops / fl.fp32 * 1e3:8.3f} ms ({ours * fl.fp32 / flops:4.2f}x)"
                 if M in prefill else "")
        print(f"  {name:<22} {N:>6} x {K:<5} M={M:<4} ours {ours * 1e3:8.3f} ms  torch bf16 "
              f"{tb * 1e3:8.3f}  fp32 {tf * 1e3:8.3f}  floor {floor * 1e3:8.3f} ms  "
              f"ours/floor {ours / floor:5.2f}x{extra}", flush=True)


def bench_quantized(fl: Floors, int8_shape: tuple[int, int], int4_shape: tuple[int, int],
                    rows: list[int]) -> None:
    """int8 per channel (the draft head's LM head), int4 in groups of 128 (its layers)."""
    q, s = quant.quantize_int8(torch.randn(*int8_shape) * 0.02)
    p, sc = quant.quantize_int4(torch.randn(*int4_shape) * 0.02, 128)
    cases = (("int8", int8_shape, lambda x: dispatch.int8_linear(x, q, s), q.nbytes + s.nbytes),
             ("int4 g128", int4_shape, lambda x: dispatch.int4_linear(x, p, sc, 128), p.nbytes + sc.nbytes))
    for fmt, (N, K), fn, nbytes in cases:
        for M in rows:
            x = torch.randn(M, K)
            t = timed(lambda: fn(x))
            floor = fl.of(nbytes, 2 * M * N * K)
            print(f"  {fmt:<10} {N:>6} x {K:<5} M={M:<4} ours {t * 1e3:8.3f} ms  floor {floor * 1e3:8.3f} ms  "
                  f"ours/floor {t / floor:5.2f}x", flush=True)


# ---- the whole decode step -----------------------------------------------------------------------
def bench_greedy_head(fl: Floors, N: int, K: int, rows: list[int], pairs: int = 8) -> None:
    """Greedy tokens of R rows from an N x K bf16 LM head: logits + argmax against the INT8
    screen (sample/greedy_screen.py), taken in turn, medians; the screen's floor is its INT8
    copy's bytes (the candidates' exact rows are a few KB)."""
    from backboard.ops.argmax_screen import build_screen, row_norms
    from backboard.sample.greedy_screen import screened_argmax

    w = torch.randn(N, K).bfloat16()
    screen = build_screen(w)
    for R in rows:
        h = torch.randn(R, K).bfloat16()
        full = lambda: dispatch.argmax(dispatch.linear(h, w, out_dtype=torch.float32))  # noqa: E731
        ts = {"full": [], "screen": []}
        for _ in range(pairs):
            ts["full"].append(timed(full, reps=0))
            ts["screen"].append(timed(lambda: screened_argmax(h, w, screen), reps=0))
        assert torch.equal(full(), screened_argmax(h, w, screen))
        approx = dispatch.int8_linear(h, screen.q, screen.scale, out_dtype=torch.float32)
        n = dispatch.screen_candidates(approx, screen.slack, row_norms(h))[1].numel()
        f, sc = (float(np.median(ts[k])) for k in ("full", "screen"))
        print(f"  {R:>2} rows: logits + argmax {f * 1e3:7.3f} ms  screen {sc * 1e3:7.3f} ms ({sc / f:4.2f}x; "
              f"{n} candidate rows)  floors {fl.of(N * K * 2, 0) * 1e3:6.3f} / "
              f"{fl.of(screen.q.nbytes, 0) * 1e3:6.3f} ms", flush=True)


def bench_model_path(cache_dir: str) -> str:
    """A checkpoint with BENCH_SHAPE (random bf16 weights), built once."""
    path = os.path.join(cache_dir, "bench-qwen3_5-h512-v248320")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import transformers as tf

    print(f"building the benchmark model in {path} ...", flush=True)
    torch.manual_seed(0)
    cfg = tf.Qwen3_5TextConfig(**BENCH_SHAPE, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    tf.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def step_bytes_flops(ours, R: int, ctx: int) -> tuple[float, float]:
    """What one decode step of R requests at context ctx must read, and its linear FLOPs."""
    params = {id(p): p for p in ours.model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    embed = ours.model.embed_tokens.weight
    linear = sum(p.numel() for p in params if p.dim() == 2 and p is not embed)
    linear += embed.numel() if ours.cfg.tie_word_embeddings else 0
    c = ours.caches
    state = 2 * (c.ssm[:, 0].nbytes + c.conv[:, 0].nbytes) if c.ssm is not None else 0
    kv = sum(2 * ctx * t[0, 0].nbytes for t in c.k)
    return weights + R * (state + kv), 2 * R * linear


def prefilled(path: str, dtype: str, R: int, ctx: int):
    """The flat-batch driver over `path` in `dtype` with R requests of ctx tokens prefilled."""
    from forward_cpu import Ours  # the benchmarks' flat-batch driver

    ours = Ours(path, dtype, R, ctx)
    rng = np.random.default_rng(0)
    ctxs = [rng.integers(0, 1000, ctx).tolist() for _ in range(R)]
    for i in range(0, len(ctxs), 16):
        ours.run([BatchRequest(np.array(c), 0, ours.blocks[j], j) for j, c in enumerate(ctxs[i:i + 16], i)])
    return ours


def decode_step(ours, R: int, ctx: int):
    """One decode step of the first R requests at position ctx (re-running it overwrites that KV
    entry: each call is a genuine decode step)."""
    step = [BatchRequest(np.array([7]), ctx, ours.blocks[i], i) for i in range(R)]
    return lambda: ours.run(step)


def bench_steps(fl: Floors, ours, dtype: str, rows: list[int], ctx: int) -> None:
    for R in rows:
        step = decode_step(ours, R, ctx)
        t, bw0, bw1 = timed_with_bandwidth(step)
        with dispatch.override("torch"):
            t_ref = timed(step, reps=2)
        nbytes, flops = step_bytes_flops(ours, R, ctx)
        floor = fl.of(nbytes, flops, (bw0 + bw1) / 2)
        moved = "  MEMORY RATE MOVED" if max(bw0, bw1) > STATE_CHANGE * min(bw0, bw1) else ""
        print(f"  [{dtype}] decode step, {R:>2} requests (ctx {ctx}): {t * 1e3:8.2f} ms  floor "
              f"{floor * 1e3:7.2f} ms ({nbytes / 1e6:6.1f} MB, {flops / 1e9:5.1f} GFLOP; read "
              f"{bw0 / 1e9:.0f} / {bw1 / 1e9:.0f} GB/s before / after)  step/floor {t / floor:5.2f}x  "
              f"{R / t:7.1f} tok/s  (torch references: {t_ref * 1e3:8.2f} ms){moved}", flush=True)


def bench_dtypes_interleaved(models: dict, rows: list[int], ctx: int, pairs: int = 8) -> None:
    """bf16 against fp32 decode steps taken in turn in one process: the ratio of their medians does
    not move with the memory rate, which on some VMs changes within minutes (a ratio of two best
    times taken minutes apart can)."""
    for R in rows:
        steps = {dt: decode_step(ours, R, ctx) for dt, ours in models.items()}
        ts = {dt: [] for dt in models}
        for _ in range(pairs):
            for dt, step in steps.items():
                t = CLOCK()
                step()
                ts[dt].append(CLOCK() - t)
        med = {dt: float(np.median(v)) for dt, v in ts.items()}
        print(f"  {R:>2} requests: bf16 / fp32 {med['bfloat16'] / med['float32']:4.2f}  (" + ", ".join(
            f"{dt} min / median {min(v) * 1e3:.2f} / {med[dt] * 1e3:.2f} ms" for dt, v in ts.items())
            + ")", flush=True)


def bench_prefill_attention(fl: Floors, nh: int, nkv: int, D: int, spans: list[tuple[int, int]]) -> None:
    """(L new tokens, S total) spans of one request through a paged bf16 cache (block size 16)."""
    from backboard.ops.attention import paged_attention_prefill_ref

    for L, S in spans:
        bs = 16
        nb = -(-S // bs)
        kc = torch.randn(nb, bs, nkv, D).bfloat16()
        vc = torch.randn_like(kc)
        row = torch.randperm(nb).to(torch.int32)
        q = torch.randn(L, nh, D).bfloat16()
        flops = 2 * 2 * nh * D * (L * (S - L) + L * (L + 1) / 2)     # QK^T and PV over the causal part
        ours = timed(lambda: dispatch.paged_attention_prefill(q, kc, vc, row, S, D ** -0.5))
        sdpa = timed(lambda: paged_attention_prefill_ref(q, kc, vc, row, S, D ** -0.5))
        print(f"  L={L:<5} S={S:<5} nh={nh} nkv={nkv} D={D}  ours {ours * 1e3:7.2f} ms "
              f"({flops / ours / 1e9:4.0f} GFLOP/s)  torch SDPA {sdpa * 1e3:7.2f} ms ({flops / sdpa / 1e9:4.0f})  "
              f"floor {flops / fl.rate * 1e3:6.2f} ms  ours/floor {ours * fl.rate / flops:4.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch threads (default: every core, as the engine uses)")
    ap.add_argument("--model", default=None, help="checkpoint (default: build BENCH_SHAPE)")
    ap.add_argument("--ctx", type=int, default=256, help="context of each decoding request")
    ap.add_argument("--quick", action="store_true", help="LM head and one layer shape, fewer rows")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time per thread (see cpu_clock), for shared machines")
    ap.add_argument("--steps-only", action="store_true",
                    help="only the bf16 decode step at 1, 4, 16, 64 rows (for back-to-back A/B runs)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = cpu_clock if args.clock == "cpu" else wall_clock
    torch.set_num_threads(args.threads)
    rows, prefill = ([1, 16], [256]) if args.quick else ([1, 4, 16, 64], [256, 512])
    mod = gemm.module()
    print(f"CPU ISA {build.cpu_isa()}; kernels: {mod.isa() if mod else 'NOT BUILT (torch references)'}; "
          f"threads {torch.get_num_threads()}; bf16 rows path up to M={gemm.POLICY[build.cpu_isa()][0]}"
          f"{f' (AMX tiles from 4 to {gemm.AMX_ROWS_MAX} rows)' if mod and mod.amx() else ''}"
          f"{' (K-interleaved copies at every row count)' if gemm.packed_copies(mod) else ''}; "
          f"clock: {args.clock}")
    fl = Floors()
    print(fl, flush=True)
    from backboard.models.tiny import default_cache_dir

    path = args.model or bench_model_path(os.path.join(default_cache_dir(), "bench"))
    from forward_cpu import Ours

    if args.steps_only:
        print("\nthe decode step (forward + logits of every request)")
        bench_steps(fl, prefilled(path, "bfloat16", max(rows), args.ctx), "bfloat16", rows, args.ctx)
        return
    ours = Ours(path, "bfloat16", 1, 16)
    shapes, cfg = linear_shapes(ours.model), ours.cfg
    del ours
    print("\nlinear layers (bf16 weights, bf16 activations)")
    for name, N, K in (shapes[:1] + shapes[-1:] if args.quick else shapes):
        bench_linear(fl, name, N, K, rows, prefill)
    print("\ngreedy tokens from the LM head (bf16 activations): logits + argmax vs the INT8 screen, in turn")
    bench_greedy_head(fl, shapes[-1][1], shapes[-1][2], [1, 2, 4])
    print("\nquantized weights (the draft head's formats), fp32 activations")
    bench_quantized(fl, shapes[-1][1:], shapes[0][1:], rows)
    print("\ncausal prefill attention, one request (the model's attention heads)")
    spans = [(256, 256), (1024, 1024)] if args.quick else [(256, 256), (1024, 1024), (512, 1024), (2048, 2048)]
    bench_prefill_attention(fl, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, spans)
    print("\nthe decode step (forward + logits of every request)")
    models = {dt: prefilled(path, dt, max(rows), args.ctx) for dt in ("bfloat16", "float32")}
    for dt, ours in models.items():
        bench_steps(fl, ours, dt, rows, args.ctx)
    print("\nbf16 against fp32 decode steps, taken in turn (median of 8 each; below 1: bf16 faster)")
    bench_dtypes_interleaved(models, rows, args.ctx)


if __name__ == "__main__":
    main()
