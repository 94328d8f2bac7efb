#!/usr/bin/env python
"""One prepared GPU check for the decode kernels (issue 7): correctness at realistic shapes, then
timings of Qwen3.5-27B steps against their floors and against plain PyTorch eager.

    python benchmarks/gpu_check.py                 # on one H200, under 8 minutes
    python benchmarks/gpu_check.py --smoke         # CPU, tiny shapes, TRITON_INTERPRET=1, < 1 min

Sections (results are written after each one, so a late failure loses nothing):
  calibrate  measured copy bandwidth (device-to-device copy, bytes read + written) and bf16 matmul
             rate: the denominators of the floors.
  checks     every Triton kernel against its torch reference at the 27B shapes (GDN decode and
             verify, paged decode attention at 8K contexts, norms, SiLU-mul, int8 / int4 GEMV),
             and the whole kernel-path forward against the model's eager forward on a 4-layer
             model of 27B width (prefill, decode, verify).
  decode     a random-weight model with the exact Qwen3.5-27B shapes (64 layers = 48 GDN + 16
             attention, BF16), one decode step (forward + LM head on the rows that need logits)
             at 1, 4, 16, 64 requests and a 256-row verify step (64 requests x 4 rows), with short
             and 8K contexts. Each figure next to its floor: bytes that must move (weights +
             KV read + GDN states read and written) / measured copy bandwidth.
  prefill    1K and 8K prompts, floor = FLOPs / measured matmul rate.
  graphs     the decode steps again as CUDA-graph replays (launch overhead removed).
  engine     the whole engine on the device (tiny hybrid, fp32): greedy tokens with CUDA graphs,
             eagerly, and with MTP speculation must be identical; output tok/s of each.
Paths: "eager" = the model's own forward with the torch references (dispatch forced to torch);
"kernels" = the same layer sequence calling backboard.ops.dispatch with Triton forced
(projections through torch.matmul); if the layers already call dispatch, "wired" = the model's
own forward with Triton forced. Ratios: floor / time ("floor_frac") and eager / kernels.

Output: benchmarks/results/gpu_check-<gpu name>-<date>.json (or --out DIR) and a printed table.
Needs torch with CUDA, triton and numpy; nothing else (written for torch 2.11 / triton 3.6; it has
only run in --smoke mode so far).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import functools
import inspect
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU under TRITON_INTERPRET=1 (tests the script itself)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    p.add_argument("--budget-s", type=float, default=None,
                   help="every section stops starting work at its share of this many seconds "
                        "(default 420 on a GPU: the call ends within 8 minutes)")
    p.add_argument("--skip-graphs", action="store_true", help="no CUDA-graph section")
    p.add_argument("--skip-eager-8k", action="store_true",
                   help="do not time the eager path with 8K contexts (the most memory-hungry runs)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"          # before anything imports triton
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from backboard.config import ModelConfig  # noqa: E402
from backboard.forward_context import get_forward_context, set_forward_context  # noqa: E402
from backboard.layers.rotary import RotaryEmbedding  # noqa: E402
from backboard.models.qwen3_5 import Qwen3_5ForCausalLM  # noqa: E402
from backboard.ops import dispatch as D  # noqa: E402
from backboard.ops import quant  # noqa: E402
from backboard.ops.attention import paged_attention_decode_ref, paged_attention_prefill, write_kv  # noqa: E402
from backboard.ops.norm import gated_rms_norm_ref, rms_norm_ref  # noqa: E402
from backboard.worker.input_batch import BatchRequest, prepare_batch  # noqa: E402
from backboard.worker.memory import allocate_caches  # noqa: E402

GB = 1e9


# ==== the time budget ==========================================================================
# Every section stops starting new work at its share of --budget-s (counted from the start), so
# one call stays under 8 minutes whatever is slow; skipped items are reported as skipped.
SECTION_END = {"checks": 0.30, "e2e": 0.36, "engine": 0.55, "decode": 0.80, "prefill": 0.88,
               "graphs": 1.0}


class Clock:
    def __init__(self, budget_s: float, t0: float | None = None) -> None:
        self.budget_s, self.t0 = budget_s, time.time() if t0 is None else t0

    def past(self, section: str) -> bool:
        """The section's share of the budget is used up: start nothing new in it."""
        return time.time() - self.t0 > SECTION_END[section] * self.budget_s


CLOCK = Clock(float("inf"))


def skipped(name: str, section: str) -> dict:
    return dict(name=name, ok=None, skipped=f"{section}: out of time budget")


# ==== shapes ====================================================================================
@dataclasses.dataclass
class Plan:
    smoke: bool
    device: torch.device
    dtype: torch.dtype
    dims: dict
    batch_sizes: tuple[int, ...]
    contexts: dict[str, int]              # label -> context tokens before the step
    verify: tuple[int, int]               # (requests, rows per request)
    prefill_lens: tuple[int, ...]
    block_size: int
    warmup: int
    reps: int
    check_dims: dict                      # shapes of the kernel checks
    budget_s: float


DIMS_27B = dict(vocab=248320, hidden=5120, inter=17408, layers=64, nh=24, nkv=4, hd=256,
                lk=16, lv=48, dk=128, dv=128)
DIMS_TINY = dict(vocab=256, hidden=64, inter=96, layers=2, nh=4, nkv=2, hd=32,
                 lk=2, lv=4, dk=32, dv=16, attn_every=2)    # [GDN, attention]


def make_plan(args: argparse.Namespace) -> Plan:
    if args.smoke:
        return Plan(True, torch.device("cpu"), torch.bfloat16, DIMS_TINY, (2,), {"short": 5, "long": 35},
                    (2, 2), (12,), 16, 0, 1,
                    dict(B=3, Bv=2, L=3, attn_B=2, attn_ctx=45, T=5, M=(1, 5), N=70, K=256,
                         groups=(32, 64), inter=40, e2e_layers=2, e2e_vocab=256, e2e_prompts=(19, 6)),
                    args.budget_s or 3600.0)      # the smoke test wants every section run
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --smoke to test the script on a CPU)")
    return Plan(False, torch.device("cuda"), torch.bfloat16, DIMS_27B, (1, 4, 16, 64),
                {"short": 128, "8k": 8192}, (64, 4), (1024, 8192), 16, 2, 5,
                dict(B=64, Bv=16, L=4, attn_B=16, attn_ctx=8192, T=256, M=(1, 16, 64), N=32768,
                     K=5120, groups=(32, 64, 128), inter=17408, e2e_layers=4, e2e_vocab=8192,
                     e2e_prompts=(300, 77)),
                args.budget_s or 420.0)


def model_config(dims: dict, num_layers: int | None = None, vocab: int | None = None,
                 max_len: int = 16384) -> ModelConfig:
    n = num_layers or dims["layers"]
    kw = dict(
        path="", model_type="qwen3_5_text", text_model_type="qwen3_5_text",
        architectures=("Qwen3_5ForCausalLM",), dtype="bfloat16",
        vocab_size=vocab or dims["vocab"], hidden_size=dims["hidden"],
        intermediate_size=dims["inter"], num_hidden_layers=n,
        num_attention_heads=dims["nh"], num_key_value_heads=dims["nkv"], head_dim=dims["hd"],
        rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25,
        max_position_embeddings=262144,
        layer_types=tuple("full_attention" if (i + 1) % dims.get("attn_every", 4) == 0 else "linear_attention"
                          for i in range(n)),
        attn_output_gate=True, norm_zero_centered=True, tie_word_embeddings=False,
        linear_num_key_heads=dims["lk"], linear_num_value_heads=dims["lv"],
        linear_key_head_dim=dims["dk"], linear_value_head_dim=dims["dv"],
        linear_conv_kernel_dim=4, gdn_projection_layout="split", mtp_num_hidden_layers=0,
        eos_token_ids=(), max_model_len=max_len)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in kw.items() if k in known})


@torch.no_grad()
def build_model(cfg: ModelConfig, plan: Plan, seed: int = 0) -> Qwen3_5ForCausalLM:
    with plan.device:
        model = Qwen3_5ForCausalLM(cfg, plan.dtype)
    g = torch.Generator(device=plan.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(1.0, 16.0, generator=g).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(-1.0, 1.0, generator=g))
        elif name.endswith("linear_attn.norm_weight"):          # plain norm: weights near 1
            p.normal_(1.0, 0.02, generator=g)
        elif "norm" in name:                                    # zero-centred: near 0
            p.normal_(0.0, 0.02, generator=g)
        elif name.endswith("conv1d_weight"):
            p.normal_(0.0, 0.3, generator=g)
        else:
            p.normal_(0.0, 0.02, generator=g)
    return model.eval()


# ==== the kernel path: the model's layer sequence through backboard.ops.dispatch ===============
class KernelPath:
    """The decoder forward of Qwen3_5ForCausalLM with every op that has a kernel called through
    dispatch: fused residual-add + RMSNorm, q/k norms, the fused GDN decode step, paged decode
    attention, SiLU-mul, the gated GDN norm on prefill spans. Projections go through F.linear;
    prefill GDN / attention cores stay on the torch ops (chunked delta rule, SDPA)."""

    def __init__(self, model: Qwen3_5ForCausalLM) -> None:
        self.m = model
        self.cfg = model.cfg
        self.eps = model.cfg.rms_norm_eps
        self.zc = model.cfg.norm_zero_centered

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m, eps, zc = self.m, self.eps, self.zc
        h = m.embed_tokens(input_ids)                                      # [T, H]
        layers = list(m.layers)
        residual = h
        x = D.rms_norm(h, layers[0].input_layernorm.weight, eps, zc)
        for i, layer in enumerate(layers):
            mix = self.gdn(layer.linear_attn, x) if layer.is_gdn else self.attn(layer.self_attn, x, positions)
            x, residual = D.fused_add_rms_norm(mix, residual, layer.post_attention_layernorm.weight, eps, zc)
            y = self.mlp(layer.mlp, x)
            nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else m.norm.weight
            x, residual = D.fused_add_rms_norm(y, residual, nxt, eps, zc)
        return x                                                           # = norm(h_final)

    def mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        return F.linear(D.silu_mul(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)

    def gdn(self, mod, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        meta = ctx.meta
        conv_state, ssm_state = ctx.caches.conv[mod.gdn_idx], ctx.caches.ssm[mod.gdn_idx]
        T = x.shape[0]
        proj = F.linear(x, mod.in_proj.weight)                             # [T, C + vd + 2 nv]
        kw = dict(num_k_heads=mod.nk, num_v_heads=mod.nv, head_k_dim=mod.dk, head_v_dim=mod.dv,
                  eps=mod.eps)
        parts = []
        for grp in meta.groups:
            src = meta.state_slots[grp.req_start:grp.req_end]
            dst = grp.dst_slots if grp.dst_slots is not None else src
            init = meta.has_initial_state[grp.req_start:grp.req_end]
            parts.append(D.gdn_decode(proj[grp.tok_start:grp.tok_end], mod.conv1d_weight, conv_state,
                                      mod.A_log, mod.dt_bias, mod.norm_weight, ssm_state, src, dst,
                                      init, **kw))
        if meta.num_prefills:
            parts.append(mod._prefill(proj[meta.prefill_tok_start:], conv_state, ssm_state, meta))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        assert out.shape[0] == T
        return F.linear(out, mod.out_proj.weight)

    def attn(self, mod, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        meta = ctx.meta
        pa = mod.attn
        k_cache, v_cache = ctx.caches.k[pa.attn_idx], ctx.caches.v[pa.attn_idx]
        T, nh, nkv, Dh = x.shape[0], mod.nh, mod.nkv, mod.D
        q, k, v = mod.qkv_proj.split(F.linear(x, mod.qkv_proj.weight))
        if mod.gated:
            qg = q.view(T, nh, 2 * Dh)
            q, gate = qg[..., :Dh], qg[..., Dh:]
        else:
            q, gate = q.view(T, nh, Dh), None
        q = D.rms_norm(q, mod.q_norm.weight, self.eps, self.zc)
        k = D.rms_norm(k.reshape(T, nkv, Dh), mod.k_norm.weight, self.eps, self.zc)
        cos, sin = mod.rotary.cos_sin(positions, x.dtype)
        q, k = RotaryEmbedding.apply(q, cos, sin).contiguous(), RotaryEmbedding.apply(k, cos, sin)
        write_kv(k, v.view(T, nkv, Dh), k_cache, v_cache, meta.slot_mapping)
        parts = []
        for g in meta.groups:
            rs, re = g.req_start, g.req_end
            qg_ = q[g.tok_start:g.tok_end].view(g.num_reqs, g.L, nh, Dh)
            max_len = int(meta.seq_lens_cpu[rs:re].max())
            o = D.paged_attention_decode(qg_, k_cache, v_cache, meta.block_table[rs:re],
                                         meta.seq_lens[rs:re], max_len, pa.scale)
            parts.append(o.reshape(-1, nh, Dh))
        qsl = meta.query_start_loc_cpu
        for r in range(meta.prefill_start, meta.num_reqs):
            s, e = int(qsl[r]), int(qsl[r + 1])
            parts.append(paged_attention_prefill(q[s:e], k_cache, v_cache, meta.block_table[r],
                                                 int(meta.seq_lens_cpu[r]), pa.scale))
        o = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(T, nh * Dh)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(T, nh * Dh))
        return F.linear(o, mod.o_proj.weight)


def layers_wired() -> bool:
    """Whether the model's layers already call backboard.ops.dispatch."""
    import backboard.layers.attention as la
    import backboard.layers.gated_deltanet as lg
    import backboard.layers.mlp as lm
    import backboard.layers.norm as ln
    return any("dispatch" in inspect.getsource(mod) for mod in (la, lg, lm, ln))


# ==== helpers ===================================================================================
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of fn() in milliseconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(max(1, reps)):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float, **info) -> dict:
    o, r = out.float(), ref.float()
    diff = (o - r)
    finite = bool(torch.isfinite(o).all())
    rel = float(diff.norm() / r.norm().clamp_min(1e-30))
    res = dict(name=name, max_abs=float(diff.abs().max()) if diff.numel() else 0.0, rel_l2=rel,
               tol=tol, ok=bool(finite and rel <= tol), **info)
    return res


def _copy_bandwidth(dev: torch.device, nbytes: int, warmup: int, reps: int) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), dev, warmup, reps)
    return 2 * nbytes / (ms * 1e-3)


def _matmul_rate(dev: torch.device, dtype: torch.dtype, n: int, warmup: int, reps: int) -> float:
    """FLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    ms = time_ms(lambda: a @ b, dev, warmup, reps)
    return 2 * n ** 3 / (ms * 1e-3)


def calibrate(plan: Plan) -> dict:
    warm, reps = (1, 2) if plan.smoke else (2, 10)
    nbytes = (64 << 20) if plan.smoke else (4 << 30)
    n = 256 if plan.smoke else 8192
    bw = _copy_bandwidth(plan.device, nbytes, warm, reps)
    rate = _matmul_rate(plan.device, plan.dtype, n, warm, reps)
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(copy_bandwidth_GBps=bw / GB, copy_bytes=2 * nbytes, matmul_TFLOPs=rate / 1e12, matmul_size=n)


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
        for bv in ((dv,) if plan.smoke else (dv, 32, 16)):
            variant = functools.partial(gdn_kernels.gdn_decode, block_v=bv)
            run_case(out, plan, calib, f"{name} block_v={bv}", prep, gdn(D.gdn_decode_ref), gdn(variant),
                     [("out", tol), ("conv_state", exact), ("ssm_state", tol)], nbytes)

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


# ==== section: timings ==========================================================================
def param_bytes(model: torch.nn.Module) -> dict:
    emb = model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(total=total, embedding=emb.numel() * emb.element_size())


def decode_floor(cfg: ModelConfig, model, plan: Plan, B: int, L: int, ctx: int, bw: float) -> dict:
    pb = param_bytes(model)
    it = plan.dtype.itemsize
    rows = B * L
    weights = pb["total"] - pb["embedding"] + rows * cfg.hidden_size * it      # embedding rows only
    n_attn, n_gdn = len(cfg.attn_layer_ids), len(cfg.gdn_layer_ids)
    kv = n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * it * B * (ctx + L)
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * it
    state = n_gdn * (ssm + conv) * (B + B * L)       # B states read; B (decode) or B*L (verify) written
    total = weights + kv + state
    return dict(weights=weights, kv=kv, state=state, total=total, floor_ms=total / bw * 1e3)


def prefill_floor(cfg: ModelConfig, model, T: int, rate: float) -> dict:
    pb = param_bytes(model)
    lm = model.lm_head.weight.numel()
    mat_params = (pb["total"] - pb["embedding"]) / 2 - lm                      # bf16 -> elements
    n_attn, n_gdn = len(cfg.attn_layer_ids), len(cfg.gdn_layer_ids)
    linear = 2 * mat_params * T + 2 * lm                                        # LM head: 1 row
    attn = n_attn * 2 * T * T * cfg.num_attention_heads * cfg.head_dim           # causal QK^T + PV
    nv, dk, dv, Cc = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, 64
    gdn = n_gdn * T * 2 * nv * (2 * Cc * dk + Cc * dv + 3 * dk * dv)           # chunked form, approx.
    total = linear + attn + gdn
    return dict(linear_flops=linear, attn_flops=attn, gdn_flops=gdn, total=total,
                floor_ms=total / rate * 1e3)


class Bench:
    def __init__(self, plan: Plan, calib: dict, results: dict, save, skip_eager_8k: bool = False) -> None:
        self.plan, self.calib, self.results, self.save = plan, calib, results, save
        self.skip_eager_8k = skip_eager_8k
        cfg = model_config(plan.dims, max_len=max(plan.contexts.values()) + max(plan.prefill_lens) + 64)
        self.cfg = cfg
        self.model = build_model(cfg, plan)
        self.kpath = KernelPath(self.model)
        self.wired = layers_wired()
        bs = plan.block_size
        max_ctx = max(max(plan.contexts.values()) + plan.verify[1], max(plan.prefill_lens))
        self.blocks_per_req = -(-max_ctx // bs)
        max_reqs = max(max(plan.batch_sizes), plan.verify[0])
        self.slots_per_req = plan.verify[1]
        self.caches = allocate_caches(cfg, max_reqs * self.blocks_per_req + 1, bs,
                                      max_reqs * self.slots_per_req, plan.dtype, plan.device)
        self.rng = np.random.default_rng(0)

    def batch(self, B: int, L: int, ctx: int, verify: bool):
        reqs = []
        for i in range(B):
            blocks = list(range(i * self.blocks_per_req, (i + 1) * self.blocks_per_req))
            slot = i * self.slots_per_req
            dst = [slot + j for j in range(L)] if verify else None
            reqs.append(BatchRequest(self.rng.integers(0, self.cfg.vocab_size, L), ctx, blocks, slot, dst))
        pb = prepare_batch(reqs, self.plan.block_size, self.plan.device)
        rows = torch.arange(pb.meta.num_tokens, device=self.plan.device)
        if ctx == 0:                                        # prefill: only the last token of each
            rows = torch.as_tensor(pb.query_start_loc[1:] - 1, device=self.plan.device)
        return pb, rows

    def step_fn(self, path: str, pb, rows):
        model, kpath = self.model, self.kpath
        fwd = kpath if path == "kernels" else model
        mode = "torch" if path == "eager" else "triton"

        @torch.no_grad()
        def step():
            with set_forward_context(pb.meta, self.caches), D.override(mode):
                hidden = fwd(pb.input_ids, pb.meta.positions)
                return model.compute_logits(hidden[rows])
        return step

    def paths(self) -> list[str]:
        return ["eager", "kernels"] + (["wired"] if self.wired else [])

    def run_one(self, entry: dict, path: str, fn, floor_ms: float, section: str) -> None:
        if CLOCK.past(section):
            entry[f"{path}_ms"] = None
            entry.setdefault("skipped", []).append(path)
            return
        try:
            ms = time_ms(fn, self.plan.device, self.plan.warmup, self.plan.reps)
            entry[f"{path}_ms"] = ms
            entry[f"{path}_floor_frac"] = floor_ms / ms
        except torch.cuda.OutOfMemoryError as e:
            entry[f"{path}_ms"] = None
            entry[f"{path}_error"] = f"OOM: {str(e).splitlines()[0]}"
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - record and go on
            entry[f"{path}_ms"] = None
            entry[f"{path}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            if self.plan.smoke:
                raise

    def decode(self) -> list[dict]:
        plan, cfg = self.plan, self.cfg
        bw = self.calib["copy_bandwidth_GBps"] * GB
        configs = [(B, 1, label, ctx, False) for label, ctx in plan.contexts.items() for B in plan.batch_sizes]
        configs += [(plan.verify[0], plan.verify[1], label, ctx, True) for label, ctx in plan.contexts.items()]
        out = self.results.setdefault("decode", [])
        for B, L, label, ctx, verify in configs:
            pb, rows = self.batch(B, L, ctx, verify)
            floor = decode_floor(cfg, self.model, plan, B, L, ctx, bw)
            e = dict(name=f"{'verify' if verify else 'decode'} B={B} L={L} ctx={label}", B=B, L=L,
                     context=ctx, rows=B * L, floor_bytes={k: v for k, v in floor.items() if k != "floor_ms"},
                     floor_ms=floor["floor_ms"])
            out.append(self.time_paths(e, pb, rows, "decode", skip_eager=ctx >= 8192 and self.skip_eager_8k))
        return out

    def time_paths(self, e: dict, pb, rows, section: str, skip_eager: bool = False) -> dict:
        """Time one step through every path next to its floor; save and print the row."""
        for path in self.paths():
            if not (path == "eager" and skip_eager):
                self.run_one(e, path, self.step_fn(path, pb, rows), e["floor_ms"], section)
        if e.get("eager_ms") and e.get("kernels_ms"):
            e["eager_over_kernels"] = e["eager_ms"] / e["kernels_ms"]
        self.save()
        print_row(e)
        return e

    def prefill(self) -> list[dict]:
        plan, cfg = self.plan, self.cfg
        rate = self.calib["matmul_TFLOPs"] * 1e12
        out = self.results.setdefault("prefill", [])
        for T in plan.prefill_lens:
            pb, rows = self.batch(1, T, 0, False)
            floor = prefill_floor(cfg, self.model, T, rate)
            e = dict(name=f"prefill T={T}", tokens=T, floor_flops={k: v for k, v in floor.items() if k != "floor_ms"},
                     floor_ms=floor["floor_ms"])
            out.append(self.time_paths(e, pb, rows, "prefill"))
        return out

    def graphs(self) -> list[dict]:
        """Decode steps replayed from CUDA graphs (kernels at every config, eager at short ones)."""
        plan = self.plan
        out = self.results.setdefault("graphs", [])
        for e in self.results.get("decode", []):
            B, L, ctx = e["B"], e["L"], e["context"]
            verify = e["name"].startswith("verify")
            g_e = dict(name=e["name"] + " [graph]", floor_ms=e["floor_ms"])
            for path in ("kernels", "eager"):
                if path == "eager" and ctx >= 8192:
                    continue
                if CLOCK.past("graphs"):
                    g_e.setdefault("skipped", []).append(path)
                    continue
                pb, rows = self.batch(B, L, ctx, verify)
                try:
                    ms = graph_time_ms(self.step_fn(path, pb, rows), plan.warmup, plan.reps * 4)
                    g_e[f"{path}_ms"] = ms
                    g_e[f"{path}_floor_frac"] = e["floor_ms"] / ms
                except Exception as ex:  # noqa: BLE001 - capture failures are reported, not fatal
                    g_e[f"{path}_error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}"
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            out.append(g_e)
            self.save()
            print_row(g_e)
        return out


def graph_time_ms(step, warmup: int, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(max(2, warmup)):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    try:
        return time_ms(graph.replay, torch.device("cuda"), 2, reps)
    finally:
        del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ==== reporting =================================================================================
def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_row(e: dict) -> None:
    parts = [f"{e['name']:<34}", f"floor {fmt(e.get('floor_ms'), '8.3f')} ms"]
    for path in ("eager", "kernels", "wired"):
        if f"{path}_ms" in e or f"{path}_error" in e:
            ms = e.get(f"{path}_ms")
            frac = e.get(f"{path}_floor_frac")
            err = e.get(f"{path}_error")
            parts.append(f"{path} {fmt(ms, '9.3f')} ms ({fmt(frac and 100 * frac, '5.1f')}% of floor)"
                         + (f" [{err[:40]}]" if err else ""))
    if e.get("eager_over_kernels"):
        parts.append(f"eager/kernels {e['eager_over_kernels']:.2f}x")
    print("  ".join(parts), flush=True)


def print_check(ck: dict) -> None:
    if ck.get("skipped"):
        print(f"  [---] {ck['name']:<44} skipped ({ck['skipped']})", flush=True)
        return
    head = f"  [{'ok ' if ck['ok'] else 'BAD'}] {ck['name']:<44} {ck.get('what', ''):<10}"
    if ck["name"].startswith("engine"):
        print(f"{head} {'identical' if ck['ok'] else 'DIFFERENT'} tokens, {ck['tok_per_s']:.1f} tok/s, "
              f"graphs={ck['graphs']}" + (f" ERROR {ck['error']}" if ck.get("error") else ""), flush=True)
        return
    if "error" in ck:
        print(f"{head} ERROR {ck['error'][:200]}", flush=True)
        return
    line = f"{head} rel {ck['rel_l2']:.1e} (tol {ck['tol']:.0e}) max_abs {ck['max_abs']:.1e}"
    if "kernel_ms" in ck:
        line += (f"  kernel {ck['kernel_ms'] * 1e3:8.1f} us ({ck['kernel_GBps']:6.0f} GB/s, "
                 f"{100 * ck['bw_frac']:4.1f}% of copy bw)  torch/kernel {ck['torch_over_kernel']:.1f}x")
    print(line, flush=True)


def gpu_name(plan: Plan) -> str:
    if plan.device.type == "cuda":
        return torch.cuda.get_device_name(plan.device)
    return f"cpu-{platform.machine()}"


def run_timings(plan: Plan, args: argparse.Namespace, calib: dict, results: dict, save, t_start: float) -> None:
    bench = Bench(plan, calib, results, save, args.skip_eager_8k)
    results["wired"] = bench.wired
    results["model_param_bytes"] = param_bytes(bench.model)
    print(f"model: {bench.cfg.num_hidden_layers} layers, {results['model_param_bytes']['total'] / GB:.1f} GB "
          f"of weights; timing paths: {', '.join(bench.paths())}", flush=True)
    bench.decode()
    print(f"decode done at {time.time() - t_start:.0f} s", flush=True)
    bench.prefill()
    save()
    if plan.device.type == "cuda" and not args.skip_graphs:
        try:
            bench.graphs()
        except Exception as ex:  # noqa: BLE001 - graphs are the last section; report and finish
            traceback.print_exc()
            results["graphs_error"] = f"{type(ex).__name__}: {ex}"[:2000]


def engine_check(plan: Plan) -> list[dict]:
    """The engine end to end on the device: greedy outputs identical with CUDA graphs (replayed
    decode and verify steps, the profiling pass sizing the cache), eagerly, and with MTP
    speculation; output tokens/s of each. On a GPU a configuration that should replay graphs
    fails loudly when the runner fell back to eager (a failed capture is only logged there)."""
    import tempfile

    from backboard import SamplingParams
    from backboard.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(os.path.join(tempfile.mkdtemp(), "tiny"), arch="qwen3_5")
    rng = np.random.default_rng(0)
    n_prompts, n_tokens = (8, 12) if plan.smoke else (24, 64)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(5, 120, n_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    on_gpu = plan.device.type == "cuda"
    out, ref = [], None
    for name, kw in (("eager", dict(enforce_eager=True)), ("graphs", {}),
                     ("graphs+mtp k=3", dict(speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                                                 "adaptive": False}))):
        if CLOCK.past("engine"):
            out.append(skipped(f"engine {name}", "engine"))
            continue
        ck, toks = _engine_run(path, name, kw, prompts, sp, on_gpu)
        ref = ref or toks
        ck["ok"] = toks == ref and not ck.get("error")
        out.append(ck)
    return out


def graph_fallback(name: str, on_gpu: bool, graphs: bool) -> str | None:
    """The error of an engine run that should have replayed CUDA graphs but ran eagerly."""
    if on_gpu and "graphs" in name and not graphs:
        return "CUDA graph capture failed: the runner fell back to eager (see its warning above)"
    return None


def _engine_run(path: str, name: str, kw: dict, prompts, sp, on_gpu: bool) -> tuple[dict, list]:
    from backboard import LLM
    t0 = time.time()
    llm = LLM(path, device="cuda" if on_gpu else "cpu", dtype="float32", max_model_len=256,
              max_num_seqs=16, gpu_memory_utilization=0.3, **kw)
    start_s = time.time() - t0
    llm.generate(prompts[:2], sp)
    t0 = time.time()
    toks = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    dt = time.time() - t0
    graphs = llm.engine.runner.graphs is not None
    ck = dict(name=f"engine {name}", what="tokens", rel_l2=0.0, tol=0.0, max_abs=0.0,
              tok_per_s=sum(map(len, toks)) / dt, startup_s=start_s, graphs=graphs,
              kv_blocks=llm.engine.runner.num_blocks)
    err = graph_fallback(name, on_gpu, graphs)
    if err:
        ck["error"] = err
        print(f"  !!! engine {name}: {err}", flush=True)
    print(f"  engine {name:<16} {ck['tok_per_s']:8.1f} tok/s graphs={graphs} kv_blocks={ck['kv_blocks']} "
          f"start-up {start_s:.1f} s", flush=True)
    del llm
    if on_gpu:
        torch.cuda.empty_cache()
    return ck, toks


def main(args: argparse.Namespace) -> int:
    global CLOCK
    t_start = time.time()
    plan = make_plan(args)
    CLOCK = Clock(plan.budget_s, t_start)
    torch.manual_seed(0)
    name = gpu_name(plan)
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu_check-{safe}-{stamp}{'-smoke' if plan.smoke else ''}.json"
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    results: dict = dict(gpu=name, date=stamp, smoke=plan.smoke, torch=torch.__version__,
                         triton=triton_version, python=platform.python_version(),
                         shapes=plan.dims, dtype=str(plan.dtype).replace("torch.", ""),
                         notes=["floor_frac = floor / measured time; "
                                "eager_over_kernels = eager time / kernel-path time",
                                "decode floor: (weights + KV read + GDN states read and written) / copy bandwidth",
                                "prefill floor: (matmul + attention + chunked-GDN FLOPs) / measured bf16 matmul rate"])

    def save() -> None:
        results["elapsed_s"] = time.time() - t_start
        path.write_text(json.dumps(results, indent=1, default=str))

    print(f"gpu_check on {name} (torch {torch.__version__}, triton {triton_version}); results -> {path}", flush=True)
    results["calibration"] = calib = calibrate(plan)
    print(f"copy bandwidth {calib['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {calib['matmul_TFLOPs']:.1f} TFLOP/s"
          f" ({time.time() - t_start:.0f} s)", flush=True)
    save()

    checks = kernel_checks(plan, calib)
    results["checks"] = checks
    save()
    print(f"kernel checks done at {time.time() - t_start:.0f} s", flush=True)
    for name, check in (("e2e", e2e_check), ("engine", engine_check)):
        if CLOCK.past(name):
            checks.append(skipped(name, name))
            continue
        try:
            checks += check(plan)
        except Exception as e:  # noqa: BLE001 - record the failure, keep the other results
            if plan.smoke:
                raise
            traceback.print_exc()
            checks.append(dict(name=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
    results["checks"] = checks
    save()
    print(f"checks done at {time.time() - t_start:.0f} s", flush=True)
    for ck in checks:
        print_check(ck)
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()

    try:
        run_timings(plan, args, calib, results, save, t_start)
    except Exception as ex:  # noqa: BLE001 - keep the checks and whatever was timed
        if plan.smoke:
            raise
        traceback.print_exc()
        results["timings_error"] = f"{type(ex).__name__}: {ex}"[:2000]
    ok = all(ck["ok"] is not False for ck in checks)
    results["all_checks_ok"] = ok
    results["checks_skipped"] = sum(ck["ok"] is None for ck in checks)
    save()
    print(f"{'all checks passed' if ok else 'SOME CHECKS FAILED'}; {time.time() - t_start:.0f} s; {path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
