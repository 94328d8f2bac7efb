"""Correctness checks: every Triton kernel against its torch reference at the plan's shapes, and
the whole kernel-path forward against the model's eager forward."""

from __future__ import annotations

import functools
import traceback

import numpy as np
import torch

from backboard.forward_context import set_forward_context
from backboard.ops import dispatch as D
from backboard.ops import quant
from backboard.ops.attention import paged_attention_decode_ref
from backboard.ops.norm import gated_rms_norm_ref, rms_norm_ref
from backboard.worker.input_batch import BatchRequest, prepare_batch
from backboard.worker.memory import allocate_caches
from benchmarks.gpucheck.budget import CLOCK, skipped
from benchmarks.gpucheck.kernel_path import KernelPath
from benchmarks.gpucheck.plan import GB, Plan, build_model, model_config
from benchmarks.gpucheck.timing import compare, time_ms


# ==== section: kernel checks ===================================================================
def _triton(fn):
    """fn with dispatch forced to the Triton kernels."""
    def call(*a, **k):
        with D.override("triton"):
            return fn(*a, **k)
    return call


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def run_case(out: list[dict], plan: Plan, calib: dict, name: str, prep, ref, ker,
             tols: list[tuple[str, float]], nbytes: int) -> None:
    """Compare ker(*prep()) with ref(*prep()) (tuples of tensors, one tolerance each), then on a
    GPU time both on the same inputs and report the kernel's achieved bandwidth."""
    if CLOCK.past("checks"):
        out.append(skipped(name, "checks"))
        return
    try:
        r = _as_tuple(ref(*prep()))
        k = _as_tuple(ker(*prep()))
        first = len(out)
        for (what, tol), x, y in zip(tols, k, r):
            out.append(compare(name, x, y, tol, what=what))
        if plan.device.type == "cuda":
            args = prep()
            tk = time_ms(lambda: ker(*args), plan.device, 3, 20)
            tr = time_ms(lambda: ref(*args), plan.device, 3, 20)
            gbps = nbytes / (tk * 1e-3) / GB
            out[first].update(kernel_ms=tk, torch_ms=tr, torch_over_kernel=tr / tk, bytes=nbytes,
                              kernel_GBps=gbps, bw_frac=gbps / calib["copy_bandwidth_GBps"])
    except Exception as e:  # noqa: BLE001 - a broken kernel is a failed check, not a crash
        if plan.smoke:
            raise
        traceback.print_exc()
        out.append(dict(name=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))


@torch.no_grad()
def kernel_checks(plan: Plan, calib: dict) -> list[dict]:
    dev, dt, d, c = plan.device, plan.dtype, plan.dims, plan.check_dims
    it = dt.itemsize
    g = torch.Generator(device=dev).manual_seed(1)

    def randn(*shape, dtype=dt, std=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * std).to(dtype)

    out: list[dict] = []
    tol = 3e-2 if plan.smoke else 2e-2
    # bit-exact where both sides round the same fp32 value once; the interpreter (smoke) truncates
    # when it rounds to bf16 instead of rounding to nearest, so there it is one bf16 ulp
    exact = tol if plan.smoke else 1e-6

    # -- GDN decode (L = 1) and verify (dst [B, L]) --
    nk, nv, dk, dv, K = d["lk"], d["lv"], d["dk"], d["dv"], 4
    C = 2 * nk * dk + nv * dv
    P = C + nv * dv + 2 * nv
    kw = dict(num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv, eps=1e-6)
    for B, L, per in ((c["B"], 1, False), (c["Bv"], c["L"], True)):
        slots = B * (L + 1) + 1
        proj = randn(B * L, P)
        wconv = randn(C, K, std=0.3)
        conv0 = randn(slots, K - 1, C)
        ssm0 = randn(slots, nv, dk, dv, dtype=torch.float32, std=0.05)
        A_log = torch.empty(nv, device=dev).uniform_(1, 16, generator=g).log()
        dt_bias = randn(nv)
        nw = (1 + randn(dv, dtype=torch.float32, std=0.02)).to(dt)
        if per:
            src = torch.randperm(B, device=dev, generator=g)             # slots [0, B)
            dst = torch.arange(B * L, device=dev).view(B, L) + B         # slots [B, B + B*L)
            dst[:, 0] = src                                              # row 0 overwrites src
        else:
            src = torch.randperm(slots - 1, device=dev, generator=g)[:B]
            dst = src
        init = torch.arange(B, device=dev) % 5 != 3
        writes = B * L if per else B
        nbytes = (B * L * P * it + B * nv * dk * dv * 4 + writes * nv * dk * dv * 4
                  + (B + writes) * (K - 1) * C * it + B * L * nv * dv * it)

        def prep(conv0=conv0, ssm0=ssm0):
            return conv0.clone(), ssm0.clone()

        def gdn(fn, proj=proj, wconv=wconv, A_log=A_log, dt_bias=dt_bias, nw=nw, src=src, dst=dst, init=init):
            def call(cs, ss):
                return fn(proj, wconv, cs, A_log, dt_bias, nw, ss, src, dst, init, **kw), cs, ss
            return call
        name = f"gdn_decode B={B} L={L}" + (" verify" if per else "")
        run_case(out, plan, calib, name, prep, gdn(D.gdn_decode_ref), gdn(_triton(D.gdn_decode)),
                 [("out", tol), ("conv_state", exact), ("ssm_state", tol)], nbytes)
        # other column splits of the recurrent kernel, for tuning (block_v >= dv fuses the norm)
        from backboard.ops.triton import gdn_decode as gdn_kernels
        from backboard.ops.triton.variants import BLOCK_V_TUNING
        for bv in ((dv,) if plan.smoke else tuple(dv if b == "head" else b for b in BLOCK_V_TUNING)):
            variant = functools.partial(gdn_kernels.gdn_decode, block_v=bv)
            run_case(out, plan, calib, f"{name} block_v={bv}", prep, gdn(D.gdn_decode_ref), gdn(variant),
                     [("out", tol), ("conv_state", exact), ("ssm_state", tol)], nbytes)

    _gdn_prefill_case(out, plan, calib, randn, kw, tol, exact)
    _prologue_case(out, plan, calib, randn, tol)

    # -- paged decode attention, decode and verify rows, long contexts --
    nh, nkv, hd, bs = d["nh"], d["nkv"], d["hd"], plan.block_size
    B, ctx = c["attn_B"], c["attn_ctx"]
    per_req = -(-(ctx + c["L"]) // bs)
    nblocks = B * per_req + 1
    kc, vc = randn(nblocks, bs, nkv, hd), randn(nblocks, bs, nkv, hd)
    bt = torch.randperm(nblocks - 1, device=dev, generator=g)[:B * per_req].view(B, per_req).int()
    for L in (1, c["L"]):
        seq = torch.randint(L, ctx + L + 1, (B,), device=dev, generator=g).int()
        seq[0] = ctx + L
        q = randn(B, L, nh, hd)
        nbytes = int(seq.sum()) * nkv * hd * it * 2 + 2 * q.numel() * it
        run_case(out, plan, calib, f"paged_attention B={B} L={L} ctx<={ctx}",
                 lambda q=q, seq=seq, L=L: (q, kc, vc, bt, seq, ctx + L, hd ** -0.5),
                 paged_attention_decode_ref, _triton(D.paged_attention_decode), [("out", tol)], nbytes)

    # -- norms, SiLU-mul --
    T, H = c["T"], d["hidden"]
    x, r, w = randn(T, H), randn(T, H), randn(H, std=0.1)
    for zc in (True, False):
        run_case(out, plan, calib, f"fused_add_rms_norm T={T} H={H} zc={zc}",
                 lambda zc=zc: (x, r, w, 1e-6, zc), D.fused_add_rms_norm_ref,
                 _triton(D.fused_add_rms_norm), [("out", tol), ("residual", exact)], 4 * T * H * it)
        run_case(out, plan, calib, f"rms_norm T={T} H={H} zc={zc}", lambda zc=zc: (x, w, 1e-6, zc),
                 rms_norm_ref, _triton(D.rms_norm), [("out", tol)], 2 * T * H * it)
    core = randn(T, nv, dv, dtype=torch.float32)
    zz = randn(T, 2 * nv * dv)[:, nv * dv:].reshape(T, nv, dv)      # a strided view, as in the layer
    nw = (1 + randn(dv, dtype=torch.float32, std=0.02)).to(dt)
    run_case(out, plan, calib, f"gated_rms_norm T={T} nv={nv} dv={dv}", lambda: (core, zz, nw, 1e-6, dt),
             gated_rms_norm_ref, _triton(D.gated_rms_norm), [("out", tol)], T * nv * dv * (4 + 2 * it))
    gu = randn(T, 2 * c["inter"])
    run_case(out, plan, calib, f"silu_mul T={T} I={c['inter']}", lambda: (gu,), D.silu_mul_ref,
             _triton(D.silu_mul), [("out", tol)], 3 * T * c["inter"] * it)

    # -- int8 / int4 weight-only matmul --
    N, Kq = c["N"], c["K"]
    wq = randn(N, Kq, dtype=torch.float32, std=0.02)
    q8, s8 = quant.quantize_int8(wq)
    for M in c["M"]:
        xq = randn(M, Kq)
        run_case(out, plan, calib, f"int8_linear M={M} N={N} K={Kq}", lambda xq=xq: (xq, q8, s8),
                 quant.int8_linear_ref, _triton(D.int8_linear), [("out", tol)], N * Kq + N * 4)
    del wq
    for G in c["groups"]:
        p4, s4 = quant.quantize_int4(randn(N, Kq, dtype=torch.float32, std=0.02), G)
        for M in c["M"][:2]:
            xq = randn(M, Kq)
            run_case(out, plan, calib, f"int4_linear M={M} N={N} K={Kq} G={G}",
                     lambda xq=xq, p4=p4, s4=s4, G=G: (xq, p4, s4, G), quant.int4_linear_ref,
                     _triton(D.int4_linear), [("out", tol)], N * Kq // 2 + s4.numel() * s4.element_size())
    return out


@torch.no_grad()
def e2e_check(plan: Plan) -> list[dict]:
    """The kernel path against the model's eager forward on a short model of full width:
    a prefill step, a decode step, a verify step, each on its own copy of the caches."""
    c = plan.check_dims
    tol = 5e-2 if plan.smoke else 3e-2      # bf16 through a few layers (the interpreter truncates)
    cfg = model_config(plan.dims, num_layers=c["e2e_layers"], vocab=c["e2e_vocab"], max_len=4096)
    model = build_model(cfg, plan, seed=2)
    kpath = KernelPath(model)
    bs = plan.block_size
    caches = {m: allocate_caches(cfg, 64, bs, 16, plan.dtype, plan.device) for m in ("eager", "kernels")}
    rng = np.random.default_rng(0)
    blocks = {0: list(range(0, 20)), 1: list(range(20, 40))}          # 320 tokens each
    prompt = dict(enumerate(c["e2e_prompts"]))
    steps = [
        ("prefill", [BatchRequest(rng.integers(0, cfg.vocab_size, prompt[i]), 0, blocks[i], i) for i in (0, 1)]),
        ("decode", [BatchRequest(rng.integers(0, cfg.vocab_size, 1), prompt[i], blocks[i], i) for i in (0, 1)]),
        ("verify", [BatchRequest(rng.integers(0, cfg.vocab_size, 3), prompt[i] + 1, blocks[i], i,
                                 spec_dst_slots=[i, 4 + 3 * i, 5 + 3 * i]) for i in (0, 1)]),
    ]
    out = []
    for name, reqs in steps:
        pb = prepare_batch(reqs, bs, plan.device)
        hid = {}
        with set_forward_context(pb.meta, caches["eager"]), D.override("torch"):
            hid["eager"] = model(pb.input_ids, pb.meta.positions)
        with set_forward_context(pb.meta, caches["kernels"]), D.override("triton"):
            hid["kernels"] = kpath(pb.input_ids, pb.meta.positions)
        out.append(compare(f"e2e {cfg.num_hidden_layers}-layer {name}", hid["kernels"], hid["eager"], tol,
                           what="final hidden"))
    ce, ck = caches["eager"], caches["kernels"]
    out.append(compare("e2e ssm states after 3 steps", ck.ssm, ce.ssm, tol))
    out.append(compare("e2e conv states after 3 steps", ck.conv, ce.conv, tol))
    del model, caches
    return out


def _gdn_prefill_case(out, plan: Plan, calib: dict, randn, kw: dict, tol: float, exact: float) -> None:
    """GDN prefill: spans across chunk boundaries in one flat batch, with and without states."""
    dev, it = plan.device, plan.dtype.itemsize
    nk, nv, dk, dv = kw["num_k_heads"], kw["num_v_heads"], kw["head_k_dim"], kw["head_v_dim"]
    C, K = 2 * nk * dk + nv * dv, 4
    lens = (40, 5, 33) if plan.smoke else (1000, 77, 3)
    cu = [0, *np.cumsum(lens).tolist()]
    P, N = cu[-1], len(lens)
    proj = randn(P, C + nv * dv + 2 * nv)
    wconv, dt_bias = randn(C, K, std=0.3), randn(nv)
    A_log = torch.empty(nv, device=dev).uniform_(1, 16).log()
    nw = (1 + randn(dv, dtype=torch.float32, std=0.02)).to(plan.dtype)
    conv0, ssm0 = randn(N + 2, K - 1, C), randn(N + 2, nv, dk, dv, dtype=torch.float32, std=0.05)
    slots = torch.tensor([2, 0, 3][:N], device=dev)
    init = torch.tensor([True, False, True][:N], device=dev)

    def call(fn):
        def run(cs, ss):
            return fn(proj, wconv, cs, A_log, dt_bias, nw, ss, cu, slots, init, **kw), cs, ss
        return run
    nbytes = P * (proj.shape[1] + C + 2 * nv * dv) * it + 2 * N * nv * dk * dv * 4
    run_case(out, plan, calib, f"gdn_prefill spans={lens}", lambda: (conv0.clone(), ssm0.clone()),
             call(D.gdn_prefill_ref), call(_triton(D.gdn_prefill)),
             [("out", 2 * tol), ("conv_state", exact), ("ssm_state", 2 * tol)], nbytes)


def _prologue_case(out, plan: Plan, calib: dict, randn, tol: float) -> None:
    """The attention prologue (q / k norms + RoPE + cache write) at the model's head shapes."""
    d, dev, it = plan.dims, plan.device, plan.dtype.itemsize
    nh, nkv, hd, T = d["nh"], d["nkv"], d["hd"], plan.check_dims["T"]
    qkv = randn(T, 2 * nh * hd + 2 * nkv * hd)
    q = qkv[:, :2 * nh * hd].view(T, nh, 2 * hd)[..., :hd]
    k = qkv[:, 2 * nh * hd:2 * nh * hd + nkv * hd].view(T, nkv, hd)
    v = qkv[:, 2 * nh * hd + nkv * hd:].view(T, nkv, hd)
    qw, kw = randn(hd, std=0.1), randn(hd, std=0.1)
    rot = hd // 4
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rot, 2, device=dev).float() / rot))
    pos = torch.randint(0, 8192, (T,), device=dev)
    cache = randn(T // plan.block_size + 2, plan.block_size, nkv, hd)
    slots = torch.randperm(cache.shape[0] * plan.block_size, device=dev)[:T]

    def call(fn):
        def run(kc, vc):
            return fn(q, k, v, qw, kw, 1e-6, True, pos, inv_freq, kc, vc, slots), kc, vc
        return run
    run_case(out, plan, calib, f"qk_norm_rope_write_kv T={T}", lambda: (cache.clone(), cache.clone()),
             call(D.qk_norm_rope_write_kv_ref), call(_triton(D.qk_norm_rope_write_kv)),
             [("q", tol), ("k_cache", tol), ("v_cache", 0.0)], 2 * T * (nh + 2 * nkv) * hd * it)
