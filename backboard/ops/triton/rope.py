"""The attention layer's prologue in one launch: per token and head, RMSNorm of q and k (the
per-head q_norm / k_norm), NeoX rotary embedding over the first `rotary_dim` dims (cos / sin from
the position and inv_freq in the kernel: no tables, nothing recomputed per layer on the host),
and the K/V cache write at slot_mapping. Replaces two norm launches, ~20 torch ops of RoPE and two
index_copy_ per attention layer.

Rounding follows ops.rotary.qk_norm_rope_write_kv_ref: the normed row, cos / sin, each product
and the sum are rounded to the model dtype, as the torch composition does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backboard.ops.triton._checks import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_tensor, next_pow2

# positions and slot_mapping are slices of the step's int64 array at offsets that follow T
_VARYING = dict(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])


@triton.jit
def _rms_rope_row(x_ptr, w_ptr, d, dmask, partner, in_rot, first_half, cos, sin, eps,
                  D: tl.constexpr, ZC: tl.constexpr, DT: tl.constexpr):
    """One head row: rmsnorm (rounded to DT), then rotate-half RoPE on the first ROT dims."""
    x = tl.load(x_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + partner, mask=dmask & in_rot, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=dmask & in_rot, other=0.0).to(tl.float32)
    if ZC:
        w = 1.0 + w
        wp = 1.0 + wp
    y = (x * inv * w).to(DT).to(tl.float32)
    yp = (xp * inv * wp).to(DT).to(tl.float32)
    rotated = tl.where(first_half, -yp, yp)
    r = (y * cos).to(DT).to(tl.float32) + (rotated * sin).to(DT).to(tl.float32)
    return tl.where(in_rot, r, y).to(DT)


@triton.jit(**_VARYING)
def _qk_norm_rope_kv_kernel(
    q_ptr, stride_qt, stride_qh,      # [T, nh, D], dim stride 1
    k_ptr, stride_kt, stride_kh,      # [T, nkv, D]
    v_ptr, stride_vt, stride_vh,      # [T, nkv, D]
    qw_ptr, kw_ptr,                   # [D] norm weights
    pos_ptr, inv_freq_ptr,            # [T] int; [ROT/2] fp32
    kc_ptr, vc_ptr, stride_cs,        # caches viewed as [slots, nkv, D]
    slot_ptr,                         # [T] int
    out_ptr,                          # q out [T, nh, D] contiguous
    NH, eps,
    D: tl.constexpr, BD: tl.constexpr, ROT: tl.constexpr, ZC: tl.constexpr, DT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BD)
    dmask = d < D
    HALF: tl.constexpr = ROT // 2
    in_rot = d < ROT
    first_half = d < HALF
    partner = tl.where(first_half, d + HALF, d - HALF)
    freq = tl.load(inv_freq_ptr + tl.where(first_half, d, d - HALF), mask=in_rot, other=0.0)
    ang = tl.load(pos_ptr + t).to(tl.float32) * freq
    cos = tl.cos(ang).to(DT).to(tl.float32)
    sin = tl.sin(ang).to(DT).to(tl.float32)
    if h < NH:
        y = _rms_rope_row(q_ptr + t * stride_qt + h * stride_qh, qw_ptr, d, dmask, partner, in_rot,
                          first_half, cos, sin, eps, D, ZC, DT)
        tl.store(out_ptr + (t * NH + h) * D + d, y, mask=dmask)
    else:
        j = h - NH
        y = _rms_rope_row(k_ptr + t * stride_kt + j * stride_kh, kw_ptr, d, dmask, partner, in_rot,
                          first_half, cos, sin, eps, D, ZC, DT)
        dst = tl.load(slot_ptr + t).to(tl.int64) * stride_cs + j * D + d
        tl.store(kc_ptr + dst, y.to(kc_ptr.dtype.element_ty), mask=dmask)
        v = tl.load(v_ptr + t * stride_vt + j * stride_vh + d, mask=dmask, other=0.0)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=dmask)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                          zero_centered: bool, positions: torch.Tensor, inv_freq: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """See ops.rotary.qk_norm_rope_write_kv_ref: q [T, nh, D], k / v [T, nkv, D] (last dim
    contiguous) -> rope(norm(q)) [T, nh, D] contiguous; rope(norm(k)) and v to the caches
    [num_blocks, block_size, nkv, D] at slot_mapping [T]."""
    op = "qk_norm_rope_write_kv"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    T, nh, D = q.shape
    check_tensor(op, "k", k, shape=(T, None, D), dtypes=(q.dtype,), last_dim_contiguous=True)
    nkv = k.shape[1]
    check_tensor(op, "v", v, shape=(T, nkv, D), dtypes=(q.dtype,), last_dim_contiguous=True)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(op, name, w, shape=(D,), dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor(op, "positions", positions, shape=(T,), dtypes=INDEX_DTYPES, contiguous=True)
    check_tensor(op, "slot_mapping", slot_mapping, shape=(T,), dtypes=INDEX_DTYPES, contiguous=True)
    check_tensor(op, "inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,), contiguous=True)
    rot = 2 * inv_freq.shape[0]
    if not 0 < rot <= D:
        raise ValueError(f"{op}: rotary dims ({rot}) must be in (0, head_dim={D}]")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, c, shape=(None, None, nkv, D), dtypes=FLOAT_DTYPES, contiguous=True)
    check_devices(op, _qk_norm_rope_kv_kernel, q=q, k=k, v=v, q_weight=q_weight,
                  k_weight=k_weight, positions=positions, inv_freq=inv_freq, k_cache=k_cache,
                  v_cache=v_cache, slot_mapping=slot_mapping)
    out = torch.empty(T, nh, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    _qk_norm_rope_kv_kernel[(T, nh + nkv)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        q_weight, k_weight, positions, inv_freq, k_cache, v_cache, nkv * D, slot_mapping, out,
        nh, float(eps), D=D, BD=next_pow2(D), ROT=rot, ZC=bool(zero_centered), DT=_TL[q.dtype],
        num_warps=1 if D <= 128 else 2)
    return out
