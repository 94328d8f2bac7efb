"""Gated DeltaNet decode / verify step: conv kernel, then recurrent kernel (+ the norm kernel).

B requests x L rows each (decode: L = 1; speculative verify: L = 1 + k), rows of request b at
flat rows b*L .. b*L + L-1. The input is the joined projection `proj` [B*L, P] with columns
[qkv (C = 2*nk*dk + nv*dv) | z (nv*dv) | b (nv) | a (nv)] (the layer's one in_proj GEMM).

1. `_gdn_decode_conv_kernel` (grid B x C/BLOCK_C): the causal depthwise conv over the cached K-1
   inputs (conv_state[src_slots[b]]) and the L new qkv rows, SiLU, rounded to the model dtype
   -> mixed [B*L, C]. Writes the window (last K-1 inputs) after the last row to
   conv_state[dst_slots[b]], or, with dst_slots [B, L], after every row to conv_state[dst[b, t]].
2. `_gdn_decode_recurrent_kernel` (grid B x nv x dv/BV: one value head, BV of its value
   columns, fp32 state tile [dk, BV] in registers): beta = sigmoid(b),
   g = -exp(A_log) * softplus(a + dt_bias), q = l2norm(q) * dk**-0.5, k = l2norm(k) (value head
   j uses key head j // (nv/nk)), the delta rule from ssm_state[src_slots[b]] (zeros where
   has_initial_state is False), the state after the last row (or after every row, dst_slots
   [B, L]) to ssm_state[dst]. The gated output norm rmsnorm(o) * w * silu(z) over dv needs the
   whole head: with BV >= dv it runs in the same kernel; with a smaller BV (the default, like
   FLA's fused recurrent kernel: many small programs keep more state loads in flight) the core
   goes out in the model dtype and `norm._gated_rms_norm_kernel` follows (a third launch).
   -> out [B*L, nv*dv] in the model dtype.

Both kernels read the source slot into registers before writing any destination slot, so a
destination may equal the source (plain decode: dst_slots = src_slots). Different requests must
not share slots (one request's destination being another's source would race).

Rounding follows the torch composition (backboard.ops.gdn.decode.gdn_decode_ref): conv output and
core output are rounded to the model dtype, the norm as ops.norm.gated_rms_norm_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backboard.ops.triton._checks import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_tensor, next_pow2
from backboard.ops.triton.norm import gated_rms_norm

# the rows per request change with the number of drafts, and the slot tensors are slices of the
# step's arrays at any offset: neither is specialised (no recompiles while serving)
_VARYING = dict(do_not_specialize=["L"], do_not_specialize_on_alignment=["src_ptr", "dst_ptr", "init_ptr"])


def _check_heads(op: str, nk: int, nv: int, dk: int, dv: int) -> None:
    if nk <= 0 or nv <= 0 or nv % nk:
        raise ValueError(f"{op}: num_v_heads ({nv}) must be a positive multiple of num_k_heads ({nk})")
    if dk <= 0 or dv <= 0:
        raise ValueError(f"{op}: head dims must be positive, got dk={dk}, dv={dv}")


@triton.jit(**_VARYING)
def _gdn_decode_conv_kernel(
    proj_ptr, stride_proj,            # [B*L, P]; qkv channels are columns 0..C-1
    w_ptr,                            # [C, K] contiguous
    state_ptr, stride_ss, stride_st,  # conv_state [num_slots, K-1, C], channel stride 1
    src_ptr, dst_ptr, init_ptr,       # [B]; [B] or [B, L]; [B] bool (if HAS_INIT_FLAGS)
    out_ptr, stride_out,              # mixed [B*L, C]
    L, C,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
    PER_POSITION: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    rows = tl.arange(0, KP)                                   # window columns 0..K-2
    src = tl.load(src_ptr + b).to(tl.int64)
    # the cached window, read whole before any write (dst may equal src)
    win = tl.load(state_ptr + src * stride_ss + rows[:, None] * stride_st + c[None, :],
                  mask=(rows[:, None] < K - 1) & cmask[None, :], other=0.0).to(tl.float32)
    if HAS_INIT_FLAGS:
        init = tl.load(init_ptr + b)
        win = tl.where(init != 0, win, 0.0)
    row0 = b * L
    # extended sequence: e in [0, K-1) is the window, e >= K-1 is new row e - (K-1)
    for t in range(L):
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            e = t + j
            xs = tl.sum(tl.where(rows[:, None] == e, win, 0.0), axis=0)
            xp = tl.load(proj_ptr + (row0 + e - (K - 1)) * stride_proj + c,
                         mask=cmask & ((c * 0 + e) >= K - 1), other=0.0).to(tl.float32)
            wj = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0).to(tl.float32)
            acc += (xs + xp) * wj
        y = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (row0 + t) * stride_out + c, y.to(out_ptr.dtype.element_ty), mask=cmask)
        if PER_POSITION:
            dst = tl.load(dst_ptr + row0 + t).to(tl.int64)
            for i in tl.static_range(K - 1):
                e = t + 1 + i
                xs = tl.sum(tl.where(rows[:, None] == e, win, 0.0), axis=0)
                xp = tl.load(proj_ptr + (row0 + e - (K - 1)) * stride_proj + c,
                             mask=cmask & ((c * 0 + e) >= K - 1), other=0.0).to(tl.float32)
                tl.store(state_ptr + dst * stride_ss + i * stride_st + c,
                         (xs + xp).to(state_ptr.dtype.element_ty), mask=cmask)
    if not PER_POSITION:
        dst = tl.load(dst_ptr + b).to(tl.int64)
        for i in tl.static_range(K - 1):
            e = L + i
            xs = tl.sum(tl.where(rows[:, None] == e, win, 0.0), axis=0)
            xp = tl.load(proj_ptr + (row0 + e - (K - 1)) * stride_proj + c,
                         mask=cmask & ((c * 0 + e) >= K - 1), other=0.0).to(tl.float32)
            tl.store(state_ptr + dst * stride_ss + i * stride_st + c,
                     (xs + xp).to(state_ptr.dtype.element_ty), mask=cmask)


def _check_slots(op: str, name: str, rows: int, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                 has_initial_state: torch.Tensor | None) -> tuple[int, int, bool]:
    """Slot arguments of B requests x L rows -> (B, L, per-position destinations)."""
    check_tensor(op, "src_slots", src_slots, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    B = src_slots.shape[0]
    if B == 0 or rows % B:
        raise ValueError(f"{op}: {name} has {rows} rows, not a positive multiple of B={B}")
    L = rows // B
    per_position = dst_slots.dim() == 2
    check_tensor(op, "dst_slots", dst_slots, shape=(B, L) if per_position else (B,),
                 dtypes=INDEX_DTYPES, contiguous=True)
    if has_initial_state is not None:
        check_tensor(op, "has_initial_state", has_initial_state, shape=(B,), dtypes=(torch.bool,),
                     contiguous=True)
    return B, L, per_position


def gdn_decode_conv(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                    src_slots: torch.Tensor, dst_slots: torch.Tensor,
                    has_initial_state: torch.Tensor | None = None, *, conv_dim: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Conv-state update + causal depthwise conv + SiLU for B requests x L rows.

    proj: [B*L, P >= conv_dim] (the qkv channels are its first conv_dim columns, last dim
    contiguous); conv_weight: [C, K] contiguous; conv_state: [num_slots, K-1, C] in the model
    dtype, updated in place; src_slots: [B]; dst_slots: [B] or [B, L]; has_initial_state: [B]
    bool or None. Returns mixed [B*L, C] in proj's dtype (or writes `out`)."""
    op = "gdn_decode_conv"
    check_tensor(op, "proj", proj, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    C = conv_dim
    check_tensor(op, "conv_weight", conv_weight, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    if conv_weight.shape[0] != C:
        raise ValueError(f"{op}: conv_weight has {conv_weight.shape[0]} channels, expected {C}")
    K = conv_weight.shape[1]
    if K < 2:
        raise ValueError(f"{op}: conv kernel width must be >= 2, got {K}")
    check_tensor(op, "conv_state", conv_state, shape=(None, K - 1, C), dtypes=FLOAT_DTYPES)
    if conv_state.stride(2) != 1:
        raise ValueError(f"{op}: conv_state must have a contiguous channel dim, strides {conv_state.stride()}")
    B, L, per_position = _check_slots(op, "proj", proj.shape[0], src_slots, dst_slots, has_initial_state)
    if proj.shape[1] < C:
        raise ValueError(f"{op}: proj has {proj.shape[1]} columns, fewer than conv_dim={C}")
    if out is None:
        out = torch.empty(B * L, C, dtype=proj.dtype, device=proj.device)
    check_tensor(op, "out", out, shape=(B * L, C), dtypes=(proj.dtype,), last_dim_contiguous=True)
    check_devices(op, _gdn_decode_conv_kernel, proj=proj, conv_weight=conv_weight,
                  conv_state=conv_state, src_slots=src_slots, dst_slots=dst_slots,
                  has_initial_state=has_initial_state, out=out)
    BLOCK_C = min(256, next_pow2(C))            # 40 programs per request at the 27B's C = 10240
    grid = (B, triton.cdiv(C, BLOCK_C))
    _gdn_decode_conv_kernel[grid](
        proj, proj.stride(0), conv_weight, conv_state, conv_state.stride(0), conv_state.stride(1),
        src_slots, dst_slots, has_initial_state if has_initial_state is not None else src_slots,
        out, out.stride(0), L, C,
        K=K, KP=next_pow2(K - 1), BLOCK_C=BLOCK_C, PER_POSITION=per_position,
        HAS_INIT_FLAGS=has_initial_state is not None, num_warps=2)
    return out


@triton.jit(**_VARYING)
def _gdn_decode_recurrent_kernel(
    mixed_ptr, stride_mixed,          # [B*L, C] conv output: [q | k | v]
    proj_ptr, stride_proj,            # [B*L, P]: z at z_off, b at b_off, a at a_off
    A_log_ptr, dt_bias_ptr, norm_w_ptr,
    state_ptr, stride_s_slot, stride_s_head, stride_s_k,   # [num_slots, nv, dk, dv], dv stride 1
    src_ptr, dst_ptr, init_ptr,
    out_ptr, stride_out,              # [B*L, nv*dv]: the normed output, or the core (no norm)
    L, z_off, b_off, a_off, eps, q_scale,
    R: tl.constexpr, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, FUSE_NORM: tl.constexpr,
    PER_POSITION: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)                                       # value head
    kh = h // R                                                # its key head
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)              # this program's value columns
    kmask = kk < DK
    vmask = vv < DV
    smask = kmask[:, None] & vmask[None, :]
    src = tl.load(src_ptr + b).to(tl.int64)
    s_off = kk[:, None] * stride_s_k + vv[None, :]
    S = tl.load(state_ptr + src * stride_s_slot + h * stride_s_head + s_off, mask=smask, other=0.0)
    if HAS_INIT_FLAGS:
        init = tl.load(init_ptr + b)
        S = tl.where(init != 0, S, 0.0)
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    row0 = b * L
    for t in range(L):
        row = row0 + t
        m_row = mixed_ptr + row * stride_mixed
        p_row = proj_ptr + row * stride_proj
        q = tl.load(m_row + kh * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(m_row + KEY_DIM + kh * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(m_row + 2 * KEY_DIM + h * DV + vv, mask=vmask, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        # gating (fp32): softplus with torch's threshold 20
        x = tl.load(p_row + a_off + h).to(tl.float32) + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = neg_A * softplus
        beta = tl.sigmoid(tl.load(p_row + b_off + h).to(tl.float32))
        # delta rule
        S = S * tl.exp(g)
        kv = tl.sum(k[:, None] * S, axis=0)                    # [BV]
        u = (v - kv) * beta
        S = S + k[:, None] * u[None, :]
        o = tl.sum(q[:, None] * S, axis=0)                     # [BV] fp32
        if PER_POSITION:
            dst = tl.load(dst_ptr + row).to(tl.int64)
            tl.store(state_ptr + dst * stride_s_slot + h * stride_s_head + s_off, S, mask=smask)
        o = o.to(out_ptr.dtype.element_ty)                     # the core, rounded as the layer does
        if FUSE_NORM:
            # gated norm over the whole head (BV >= DV): rmsnorm(o) * w * silu(z), with the
            # model-dtype roundings of ops.norm.gated_rms_norm_ref
            of = o.to(tl.float32)
            var = tl.sum(of * of, axis=0) / DV
            y = (of * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
            norm_w = tl.load(norm_w_ptr + vv, mask=vmask, other=0.0).to(tl.float32)
            y = (y * norm_w).to(out_ptr.dtype.element_ty).to(tl.float32)
            z = tl.load(p_row + z_off + h * DV + vv, mask=vmask, other=0.0).to(tl.float32)
            y = y * (z * tl.sigmoid(z))
            tl.store(out_ptr + row * stride_out + h * DV + vv, y.to(out_ptr.dtype.element_ty), mask=vmask)
        else:
            tl.store(out_ptr + row * stride_out + h * DV + vv, o, mask=vmask)
    if not PER_POSITION:
        dst = tl.load(dst_ptr + b).to(tl.int64)
        tl.store(state_ptr + dst * stride_s_slot + h * stride_s_head + s_off, S, mask=smask)


# value columns per program when the norm runs as its own kernel. On one H200 (gpu_check at the 27B
# shapes, benchmarks/results/gpu_check-NVIDIA-H200-20261204-*.txt), B=64 L=1 / B=16 L=4: block_v 8
# 616-706 / 303-335 us, 16 314-389 / 238-326, 32 247-299 / 214-264, 64 248 / 236, the whole head
# (fused norm) 349-415 / 322-404. 8 gave one warp per program and 16 programs per head
DEFAULT_BLOCK_V = 32


def gdn_decode_recurrent(mixed: torch.Tensor, proj: torch.Tensor, A_log: torch.Tensor,
                         dt_bias: torch.Tensor, norm_weight: torch.Tensor, ssm_state: torch.Tensor,
                         src_slots: torch.Tensor, dst_slots: torch.Tensor,
                         has_initial_state: torch.Tensor | None = None, *, num_k_heads: int,
                         num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float,
                         block_v: int | None = None) -> torch.Tensor:
    """Gating + q/k L2 norm + GQA delta rule over slotted fp32 states + gated output norm.

    mixed: [B*L, C] conv output [q | k | v], C = 2*nk*dk + nv*dv; proj: [B*L, P] the joined
    projection ([qkv | z | b | a], P = C + nv*dv + 2*nv); A_log: [nv] (fp32); dt_bias: [nv];
    norm_weight: [dv] in mixed's dtype; ssm_state: [num_slots, nv, dk, dv] fp32, updated in place;
    src_slots: [B]; dst_slots: [B] or [B, L]; has_initial_state: [B] bool or None.
    block_v: value columns per program (None: DEFAULT_BLOCK_V). With block_v >= dv one program
    holds a head's whole state and applies the gated norm itself; with fewer (more programs,
    smaller register tiles) the core goes out in the model dtype and the norm kernel
    (triton.norm.gated_rms_norm) follows.
    Returns out [B*L, nv*dv] in mixed's dtype (the input of out_proj)."""
    op = "gdn_decode_recurrent"
    nk, nv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    _check_heads(op, nk, nv, dk, dv)
    C = 2 * nk * dk + nv * dv
    P = C + nv * dv + 2 * nv
    check_tensor(op, "mixed", mixed, shape=(None, C), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    T = mixed.shape[0]
    check_tensor(op, "proj", proj, shape=(T, P), dtypes=(mixed.dtype,), last_dim_contiguous=True)
    check_tensor(op, "A_log", A_log, shape=(nv,), dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor(op, "dt_bias", dt_bias, shape=(nv,), dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor(op, "norm_weight", norm_weight, shape=(dv,), dtypes=(mixed.dtype,), contiguous=True)
    check_tensor(op, "ssm_state", ssm_state, shape=(None, nv, dk, dv), dtypes=(torch.float32,))
    if ssm_state.stride(3) != 1:
        raise ValueError(f"{op}: ssm_state must have a contiguous last dim, strides {ssm_state.stride()}")
    B, L, per_position = _check_slots(op, "mixed", T, src_slots, dst_slots, has_initial_state)
    check_devices(op, _gdn_decode_recurrent_kernel, mixed=mixed, proj=proj, A_log=A_log,
                  dt_bias=dt_bias, norm_weight=norm_weight, ssm_state=ssm_state,
                  src_slots=src_slots, dst_slots=dst_slots, has_initial_state=has_initial_state)
    block_v = DEFAULT_BLOCK_V if block_v is None else int(block_v)
    if block_v < 1:
        raise ValueError(f"{op}: block_v must be >= 1, got {block_v}")
    BK = next_pow2(dk)
    fuse = block_v >= dv
    BV = next_pow2(dv) if fuse else next_pow2(block_v)
    out = torch.empty(T, nv * dv, dtype=mixed.dtype, device=mixed.device)   # normed out or core
    grid = (B, nv, triton.cdiv(dv, BV))
    _gdn_decode_recurrent_kernel[grid](
        mixed, mixed.stride(0), proj, proj.stride(0), A_log, dt_bias, norm_weight,
        ssm_state, ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        src_slots, dst_slots, has_initial_state if has_initial_state is not None else src_slots,
        out, out.stride(0), L, C, C + nv * dv, C + nv * dv + nv, float(eps), float(dk) ** -0.5,
        R=nv // nk, KEY_DIM=nk * dk, DK=dk, DV=dv, BK=BK, BV=BV, FUSE_NORM=fuse,
        PER_POSITION=per_position, HAS_INIT_FLAGS=has_initial_state is not None,
        num_warps=max(1, min(16, BK * BV // 1024)))           # <= 32 state values per thread
    if fuse:
        return out
    z = proj[:, C:C + nv * dv].view(T, nv, dv)
    return gated_rms_norm(out.view(T, nv, dv), z, norm_weight, eps, mixed.dtype).view(T, nv * dv)


def gdn_decode(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
               ssm_state: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
               has_initial_state: torch.Tensor | None = None, *, num_k_heads: int,
               num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float,
               block_v: int | None = None) -> torch.Tensor:
    """The whole GDN decode / verify step between in_proj and out_proj (see the module doc).

    proj: [B*L, C + nv*dv + 2*nv] joined projection [qkv | z | b | a]; conv_weight [C, K];
    conv_state [num_slots, K-1, C]; A_log, dt_bias [nv]; norm_weight [dv];
    ssm_state [num_slots, nv, dk, dv] fp32; src_slots [B]; dst_slots [B] or [B, L];
    has_initial_state [B] bool or None; block_v: see gdn_decode_recurrent.
    Returns [B*L, nv*dv] in proj's dtype."""
    _check_heads("gdn_decode", num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    C = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    mixed = gdn_decode_conv(proj, conv_weight, conv_state, src_slots, dst_slots,
                            has_initial_state, conv_dim=C)
    return gdn_decode_recurrent(mixed, proj, A_log, dt_bias, norm_weight, ssm_state, src_slots,
                                dst_slots, has_initial_state, num_k_heads=num_k_heads,
                                num_v_heads=num_v_heads, head_k_dim=head_k_dim,
                                head_v_dim=head_v_dim, eps=eps, block_v=block_v)
