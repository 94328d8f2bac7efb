"""Gated DeltaNet prefill: N spans of any lengths in one flat batch, in four launches per layer
(conv, chunk transform, chunk scan, gated norm) instead of the torch glue's hundreds.

The input is the joined projection `proj` [P, C + nv*dv + 2*nv] = [qkv | z | b | a] of the spans
concatenated (span n at rows cu_seqlens[n] .. cu_seqlens[n+1]-1); states live in slots as in
the decode step (ops/triton/gdn_decode.py). The chunked form follows flash-linear-attention's
chunk_gated_delta_rule (cumsum of the log decay, K K^T, a triangular solve, W / U, then the
state scan and the outputs), fused into two kernels; chunks never cross a span boundary.

1. `_gdn_prefill_conv_kernel` (grid N x C/BLOCK_C): the causal depthwise conv + SiLU over each
   span, the first K-1 inputs from conv_state[slots[n]] (zeros without an initial state), rounded
   to the model dtype -> mixed [P, C]; then the span's last K-1 inputs to conv_state[slots[n]].
2. `_gdn_chunk_prep_kernel` (grid chunks x nv): per chunk of CHUNK tokens and value head: the
   gating (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), the in-chunk cumulative
   log decay c, k = l2norm(k), A = strict_lower(beta k k^T * exp(c_i - c_j)), T = (I + A)^-1 by
   forward substitution, W = T (beta * exp(c) * k) and U = T (beta * v) -> scratch (fp32).
3. `_gdn_chunk_scan_kernel` (grid N x nv x dv/BV): the sequential part, a span's chunks in order
   with the fp32 state tile S [dk, BV] in registers: V' = U - W S,
   o = (q * exp(c)) S + tril(q k^T * exp(c_i - c_j)) V', S = exp(c_last) S + (k * exp(c_last - c))^T V'
   (q = l2norm(q) * dk**-0.5) -> the core in the model dtype; S back to ssm_state[slots[n]].
4. `norm._gated_rms_norm_kernel`: rmsnorm(core) * w * silu(z) -> [P, nv*dv].

Rounding follows ops.gdn.prefill.gdn_prefill_ref: conv output and core rounded to the model dtype.
Matrix products run on tensor cores: the scan's in bf16 for bf16 models (as FLA) and TF32 for fp32
ones (TF32x3 spills there), the chunk transform's in TF32 (TF32x3, about fp32, for fp32 models).
At the 27B shapes on sm_90 (benchmarks/results/triton-compile-*): scan 182 registers with 8 warps
and BV = 16 (BV = 32 or 4 warps spill), chunk transform 98 (bf16), conv 119; no spills.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from backboard.ops.triton._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_tensor,
    interpreter_dot_f32,
    next_pow2,
)
from backboard.ops.triton.norm import gated_rms_norm

CHUNK = 32                  # tokens per chunk (fixed: one compiled variant per model shape)
# span offsets and slots are slices at any offset of the step's arrays: no alignment specialisation
_VARYING = dict(do_not_specialize_on_alignment=["cu_ptr", "slots_ptr", "init_ptr", "chunks_ptr"])


@triton.jit
def _extended(proj_ptr, stride_proj, win_ptr, stride_st, s, has_init, e, emask, c, cmask,
              K: tl.constexpr):
    """Rows e of a span's extended sequence (the cached window at win_ptr, then the span's qkv
    from row s) -> fp32 [E, BLOCK_C]."""
    in_span = e >= K - 1
    m = emask[:, None] & cmask[None, :]
    xp = tl.load(proj_ptr + (s + e - (K - 1))[:, None].to(tl.int64) * stride_proj + c[None, :],
                 mask=m & in_span[:, None], other=0.0).to(tl.float32)
    xw = tl.load(win_ptr + e[:, None] * stride_st + c[None, :],
                 mask=m & (~in_span[:, None]) & has_init, other=0.0).to(tl.float32)
    return xp + xw


@triton.jit(**_VARYING)
def _gdn_prefill_conv_kernel(
    proj_ptr, stride_proj,            # [P, >= C]: qkv channels are columns 0..C-1
    w_ptr,                            # [C, K] contiguous
    state_ptr, stride_ss, stride_st,  # conv_state [num_slots, K-1, C], channel stride 1
    cu_ptr, slots_ptr, init_ptr,      # [N + 1] int32; [N]; [N] bool
    out_ptr, stride_out,              # mixed [P, C]
    C,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    s = tl.load(cu_ptr + n)
    span = tl.load(cu_ptr + n + 1) - s
    win_ptr = state_ptr + tl.load(slots_ptr + n).to(tl.int64) * stride_ss
    has_init = tl.load(init_ptr + n) != 0
    tt = tl.arange(0, BLOCK_T)
    # extended sequence: index e < K-1 is the cached window, e >= K-1 is span row e - (K-1)
    for t0 in range(0, span, BLOCK_T):
        rmask = (t0 + tt) < span
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            x = _extended(proj_ptr, stride_proj, win_ptr, stride_st, s, has_init, t0 + tt + j,
                          rmask, c, cmask, K)
            acc += x * tl.load(w_ptr + c * K + j, mask=cmask, other=0.0).to(tl.float32)[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (s + t0 + tt)[:, None].to(tl.int64) * stride_out + c[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
    # the window after the span: its last K-1 inputs (older ones from the cached window when the
    # span is shorter than K-1), read whole before the write
    rows = tl.arange(0, KP)
    wmask = rows < K - 1
    win = _extended(proj_ptr, stride_proj, win_ptr, stride_st, s, has_init, span + rows, wmask,
                    c, cmask, K)
    tl.debug_barrier()              # every warp has read the old window (at t0 = 0)
    tl.store(win_ptr + rows[:, None] * stride_st + c[None, :], win.to(win_ptr.dtype.element_ty),
             mask=wmask[:, None] & cmask[None, :])


@triton.jit
def _mm(a, b, LOW: tl.constexpr, PREC: tl.constexpr):
    """a @ b with fp32 accumulation; LOW: bf16 operands (bf16 models on the GPU, as FLA does:
    half the registers of TF32 operands)."""
    if LOW:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _l2norm_rows(x):
    """[R, D] fp32 -> each row / sqrt(sum(row^2) + 1e-6) (ops.gdn.reference.l2norm)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit(**_VARYING)
def _gdn_chunk_prep_kernel(
    mixed_ptr, stride_mixed,          # [P, C] conv output [q | k | v]
    proj_ptr, stride_proj,            # [P, >= a_off + nv]: b at b_off, a at a_off
    A_log_ptr, dt_bias_ptr,           # [nv]
    chunks_ptr,                       # [num_chunks, 2] int32: first row, end row of the chunk
    c_ptr, w_ptr, u_ptr,              # scratch: c [P, nv], W [P, nv, DK], U [P, nv, DV] fp32
    b_off, a_off, NV,
    R: tl.constexpr, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BVP: tl.constexpr, CH: tl.constexpr, PREC: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    cs = tl.load(chunks_ptr + 2 * i)
    n_rows = tl.load(chunks_ptr + 2 * i + 1) - cs
    r = tl.arange(0, CH)
    rmask = r < n_rows
    rows = (cs + r).to(tl.int64)
    # gating, zero on padding rows (no decay, no update)
    x = tl.load(proj_ptr + rows * stride_proj + a_off + h, mask=rmask, other=0.0).to(tl.float32)
    x += tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = tl.where(rmask, -tl.exp(tl.load(A_log_ptr + h).to(tl.float32)) * softplus, 0.0)
    bb = tl.load(proj_ptr + rows * stride_proj + b_off + h, mask=rmask, other=0.0).to(tl.float32)
    beta = tl.where(rmask, tl.sigmoid(bb), 0.0)
    c = tl.cumsum(g, axis=0)
    tl.store(c_ptr + rows * NV + h, c, mask=rmask)
    # A = strict_lower(beta k k^T * exp(c_i - c_j))
    dd = tl.arange(0, BK)
    k = tl.load(mixed_ptr + rows[:, None] * stride_mixed + KEY_DIM + (h // R) * DK + dd[None, :],
                mask=rmask[:, None] & (dd < DK)[None, :], other=0.0).to(tl.float32)
    k = _l2norm_rows(k)
    below = r[:, None] > r[None, :]
    A = tl.dot(k * beta[:, None], tl.trans(k), input_precision=PREC)
    A = tl.where(below, A * tl.exp(tl.where(below, c[:, None] - c[None, :], 0.0)), 0.0)
    # T = (I + A)^-1, lower unitriangular: row i = e_i - sum_{j<i} A[i, j] T[j, :]
    eye = r[:, None] == r[None, :]
    T = tl.where(eye, 1.0, 0.0)
    for ri in range(1, n_rows):
        a_i = tl.sum(tl.where(r[:, None] == ri, A, 0.0), axis=0)            # A[ri, :]
        t_i = tl.where(r == ri, 1.0, -tl.sum(a_i[:, None] * T, axis=0))
        T = tl.where(r[:, None] == ri, t_i[None, :], T)
    W = tl.dot(T, k * (beta * tl.exp(c))[:, None], input_precision=PREC)   # [CH, BK]
    tl.store(w_ptr + (rows[:, None] * NV + h) * DK + dd[None, :], W,
             mask=rmask[:, None] & (dd < DK)[None, :])
    vv = tl.arange(0, BVP)
    vmask = rmask[:, None] & (vv < DV)[None, :]
    v = tl.load(mixed_ptr + rows[:, None] * stride_mixed + 2 * KEY_DIM + h * DV + vv[None, :],
                mask=vmask, other=0.0).to(tl.float32)
    U = tl.dot(T, v * beta[:, None], input_precision=PREC)                  # [CH, BVP]
    tl.store(u_ptr + (rows[:, None] * NV + h) * DV + vv[None, :], U, mask=vmask)


@triton.jit(**_VARYING)
def _gdn_chunk_scan_kernel(
    mixed_ptr, stride_mixed,          # [P, C] conv output [q | k | v]
    c_ptr, w_ptr, u_ptr,              # from _gdn_chunk_prep_kernel
    state_ptr, stride_s_slot, stride_s_head, stride_s_k,   # [num_slots, nv, dk, dv], dv stride 1
    cu_ptr, slots_ptr, init_ptr,      # [N + 1] int32; [N]; [N] bool
    out_ptr, stride_out,              # core [P, nv*dv] in the model dtype
    NV, q_scale,
    R: tl.constexpr, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, CH: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // R
    dd = tl.arange(0, BK)
    kmask = dd < DK
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = vv < DV
    s = tl.load(cu_ptr + n)
    e = tl.load(cu_ptr + n + 1)
    s_ptrs = (state_ptr + tl.load(slots_ptr + n).to(tl.int64) * stride_s_slot + h * stride_s_head
              + dd[:, None] * stride_s_k + vv[None, :])
    smask = kmask[:, None] & vmask[None, :]
    S = tl.load(s_ptrs, mask=smask & (tl.load(init_ptr + n) != 0), other=0.0)   # [BK, BV]
    r = tl.arange(0, CH)
    causal = r[:, None] >= r[None, :]
    for cs in range(s, e, CH):
        rmask = (cs + r) < e
        rows = (cs + r).to(tl.int64)
        m_k = rmask[:, None] & kmask[None, :]
        m_v = rmask[:, None] & vmask[None, :]
        c_last = tl.load(c_ptr + (tl.minimum(cs + CH, e) - 1).to(tl.int64) * NV + h)
        c = tl.where(rmask, tl.load(c_ptr + rows * NV + h, mask=rmask, other=0.0), c_last)
        q = tl.load(mixed_ptr + rows[:, None] * stride_mixed + kh * DK + dd[None, :], mask=m_k,
                    other=0.0).to(tl.float32)
        k = tl.load(mixed_ptr + rows[:, None] * stride_mixed + KEY_DIM + kh * DK + dd[None, :],
                    mask=m_k, other=0.0).to(tl.float32)
        q = _l2norm_rows(q) * q_scale
        k = _l2norm_rows(k)
        w = tl.load(w_ptr + (rows[:, None] * NV + h) * DK + dd[None, :], mask=m_k, other=0.0)
        u = tl.load(u_ptr + (rows[:, None] * NV + h) * DV + vv[None, :], mask=m_v, other=0.0)
        v_new = u - _mm(w, S, LOW, PREC)                     # [CH, BV]
        attn = _mm(q, tl.trans(k), LOW, PREC)
        attn = tl.where(causal, attn * tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0)), 0.0)
        o = _mm(q * tl.exp(c)[:, None], S, LOW, PREC)
        o += _mm(attn, v_new, LOW, PREC)
        tl.store(out_ptr + rows[:, None] * stride_out + h * DV + vv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_v)
        k_dec = tl.where(rmask[:, None], k * tl.exp(c_last - c)[:, None], 0.0)
        S = S * tl.exp(c_last) + _mm(tl.trans(k_dec), v_new, LOW, PREC)
    tl.store(s_ptrs, S, mask=smask)


# ---- launchers -----------------------------------------------------------------------------------
def _chunk_table(cu_seqlens: list[int]) -> tuple[np.ndarray, int]:
    """Host [N + 1 + 2*num_chunks] int32: cu_seqlens, then (first row, end row) of every chunk."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    starts = np.concatenate([np.arange(a, b, CHUNK) for a, b in zip(cu[:-1], cu[1:])] or [[]])
    ends = np.minimum(starts + CHUNK, np.repeat(cu[1:], -(-(cu[1:] - cu[:-1]) // CHUNK)))
    table = np.concatenate([cu, np.stack([starts, ends], 1).reshape(-1)]).astype(np.int32)
    return table, len(starts)


def _check_spans(op: str, P: int, cu_seqlens: list[int], slots: torch.Tensor,
                 has_initial_state: torch.Tensor) -> int:
    N = len(cu_seqlens) - 1
    cu = np.asarray(cu_seqlens)
    if N < 1 or cu[0] != 0 or cu[-1] != P or (np.diff(cu) <= 0).any():
        raise ValueError(f"{op}: cu_seqlens must rise strictly from 0 to {P} (the rows of proj), "
                         f"got {list(cu_seqlens)}")
    check_tensor(op, "slots", slots, shape=(N,), dtypes=INDEX_DTYPES, contiguous=True)
    check_tensor(op, "has_initial_state", has_initial_state, shape=(N,), dtypes=(torch.bool,),
                 contiguous=True)
    return N


def gdn_prefill(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                ssm_state: torch.Tensor, cu_seqlens: list[int], slots: torch.Tensor,
                has_initial_state: torch.Tensor, *, num_k_heads: int, num_v_heads: int,
                head_k_dim: int, head_v_dim: int, eps: float) -> torch.Tensor:
    """See ops.gdn.prefill.gdn_prefill_ref (same arguments, same result).

    proj: [P, C + nv*dv + 2*nv] (last dim contiguous); cu_seqlens: [N + 1] host list; slots: [N];
    has_initial_state: [N] bool. Returns [P, nv*dv] in proj's dtype."""
    op = "gdn_prefill"
    nk, nv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    if nk <= 0 or nv <= 0 or nv % nk or dk <= 0 or dv <= 0:
        raise ValueError(f"{op}: bad heads nk={nk}, nv={nv}, dk={dk}, dv={dv}")
    C = 2 * nk * dk + nv * dv
    check_tensor(op, "proj", proj, shape=(None, C + nv * dv + 2 * nv), dtypes=FLOAT_DTYPES,
                 last_dim_contiguous=True)
    P = proj.shape[0]
    N = _check_spans(op, P, cu_seqlens, slots, has_initial_state)
    K = conv_weight.shape[1] if conv_weight.dim() == 2 else 0
    check_tensor(op, "conv_weight", conv_weight, shape=(C, K), dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor(op, "conv_state", conv_state, shape=(None, K - 1, C), dtypes=FLOAT_DTYPES)
    check_tensor(op, "ssm_state", ssm_state, shape=(None, nv, dk, dv), dtypes=(torch.float32,))
    if K < 2 or conv_state.stride(2) != 1 or ssm_state.stride(3) != 1:
        raise ValueError(f"{op}: conv width >= 2 and states with a contiguous last dim required")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_tensor(op, name, t, shape=(nv,), dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor(op, "norm_weight", norm_weight, shape=(dv,), dtypes=(proj.dtype,), contiguous=True)
    check_devices(op, _gdn_chunk_scan_kernel, proj=proj, conv_weight=conv_weight,
                  conv_state=conv_state, A_log=A_log, dt_bias=dt_bias, norm_weight=norm_weight,
                  ssm_state=ssm_state, slots=slots, has_initial_state=has_initial_state)
    dev = proj.device
    table, num_chunks = _chunk_table(cu_seqlens)
    table_t = torch.from_numpy(table).to(dev)                  # one host-to-device copy
    cu_t, chunks_t = table_t[:N + 1], table_t[N + 1:]
    mixed = torch.empty(P, C, dtype=proj.dtype, device=dev)
    BLOCK_C = min(128, next_pow2(C))
    _gdn_prefill_conv_kernel[(N, triton.cdiv(C, BLOCK_C))](
        proj, proj.stride(0), conv_weight, conv_state, conv_state.stride(0), conv_state.stride(1),
        cu_t, slots, has_initial_state, mixed, mixed.stride(0), C,
        K=K, KP=next_pow2(K - 1), BLOCK_T=16, BLOCK_C=BLOCK_C, num_warps=4)
    prec = "tf32x3" if proj.dtype == torch.float32 else "tf32"     # tensor cores either way
    BK, BVP = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    cbuf = torch.empty(P, nv, dtype=torch.float32, device=dev)
    wbuf = torch.empty(P, nv, dk, dtype=torch.float32, device=dev)
    ubuf = torch.empty(P, nv, dv, dtype=torch.float32, device=dev)
    heads = dict(R=nv // nk, KEY_DIM=nk * dk, DK=dk, DV=dv, BK=BK, CH=CHUNK)
    _gdn_chunk_prep_kernel[(num_chunks, nv)](
        mixed, mixed.stride(0), proj, proj.stride(0), A_log, dt_bias, chunks_t, cbuf, wbuf, ubuf,
        C + nv * dv, C + nv * dv + nv, nv, BVP=BVP, PREC=prec, **heads, num_warps=8)
    core = torch.empty(P, nv * dv, dtype=proj.dtype, device=dev)
    BV = 16                     # 182 registers at the 27B shapes with 8 warps (32: spills)
    _gdn_chunk_scan_kernel[(N, nv, triton.cdiv(dv, BV))](
        mixed, mixed.stride(0), cbuf, wbuf, ubuf, ssm_state, ssm_state.stride(0),
        ssm_state.stride(1), ssm_state.stride(2), cu_t, slots, has_initial_state,
        core, core.stride(0), nv, float(dk) ** -0.5, BV=BV, PREC="tf32", **heads,
        LOW=proj.dtype == torch.bfloat16 and not interpreter_dot_f32(_gdn_chunk_scan_kernel, proj.dtype),
        num_warps=8, num_stages=1)
    z = proj[:, C:C + nv * dv].view(P, nv, dv)
    return gated_rms_norm(core.view(P, nv, dv), z, norm_weight, eps, proj.dtype).view(P, nv * dv)
