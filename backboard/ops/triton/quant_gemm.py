"""Weight-only int8 / int4 matmul for small M (decode GEMV up to a few hundred rows), fp32
accumulation. Formats: see backboard/ops/quant.py (int8 [N, K] + fp32 scale [N]; int4 packed
uint8 [N, K // 2], low nibble = even k, high nibble = odd k, value = nibble - 8, scales
[N, K // G]).

Grid (N / BLOCK_N, M / BLOCK_M, split_k); each program walks its share of K in BLOCK_K tiles,
converts the integer weights to the activation dtype (exact: |q| <= 127) and uses tl.dot with an
fp32 accumulator. int4 splits each tile into its even and odd columns (the low and high nibbles),
so no interleave is needed, and applies the group scale per tile (BLOCK_K divides G).

Split-K: a layer whose output tiles are fewer than the SMs (N = 5120 is 80 tiles of 64 on 132
SMs) also splits K, so that every SM streams weights; the fp32 partials [split_k, M, N] are
summed in a fixed order by `_split_k_sum_kernel` (deterministic, unlike atomics). The row count M
and the split length change from step to step and are not specialised (no recompiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backboard.ops.triton._checks import (
    FLOAT_DTYPES,
    check_devices,
    check_tensor,
    interpreter_dot_f32,
    next_pow2,
    num_sms,
)

_VARYING = dict(do_not_specialize=["M", "k_per_split"])


@triton.jit(**_VARYING)
def _int8_linear_kernel(
    x_ptr, stride_xm, q_ptr, stride_qn, s_ptr, y_ptr, stride_ym, M, N, K, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    nmask = rn < N
    mmask = rm < M
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    q_cols = q_ptr + rn.to(tl.int64)[None, :] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        kmask = kk < k_hi
        x = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(q_cols + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    s = tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    _store_tile(y_ptr, stride_ym, acc * s[None, :], rm, rn, mmask, nmask, M, N, SPLIT_K)


@triton.jit
def _store_tile(y_ptr, stride_ym, y, rm, rn, mmask, nmask, M, N, SPLIT_K: tl.constexpr):
    """The output tile, or with SPLIT_K this program's fp32 partial at [split, M, N]."""
    mask = mmask[:, None] & nmask[None, :]
    if SPLIT_K:
        base = tl.program_id(2).to(tl.int64) * M * N
        tl.store(y_ptr + base + rm.to(tl.int64)[:, None] * N + rn[None, :], y, mask=mask)
    else:
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "SPLITS"])
def _split_k_sum_kernel(p_ptr, y_ptr, stride_ym, M, N, SPLITS, BLOCK: tl.constexpr):
    """y[m, :] = sum over the splits of the fp32 partials [SPLITS, M, N], in split order."""
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = rn < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(SPLITS):
        acc += tl.load(p_ptr + (i * M + m) * N + rn, mask=nmask, other=0.0)
    tl.store(y_ptr + m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit(**_VARYING)
def _int4_linear_kernel(
    x_ptr, stride_xm, p_ptr, stride_pn, s_ptr, stride_sn, y_ptr, stride_ym, M, N, K, k_per_split,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    nmask = rn < N
    mmask = rm < M
    rj = tl.arange(0, BLOCK_K // 2)                    # packed bytes of one K tile
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    p_cols = p_ptr + rn.to(tl.int64)[None, :] * stride_pn
    s_cols = s_ptr + rn.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):              # K % BLOCK_K == 0, BLOCK_K divides GROUP
        j = k0 // 2 + rj
        p = tl.load(p_cols + j[:, None], mask=nmask[None, :], other=0)      # [BK/2, BN] uint8
        lo = ((p & 0xF).to(tl.int32) - 8)
        hi = ((p >> 4).to(tl.int32) - 8)
        xe = tl.load(x_rows + (2 * j)[None, :], mask=mmask[:, None], other=0.0)       # [BM, BK/2]
        xo = tl.load(x_rows + (2 * j + 1)[None, :], mask=mmask[:, None], other=0.0)
        if DOT_F32:
            part = tl.dot(xe.to(tl.float32), lo.to(tl.float32), input_precision="ieee")
            part += tl.dot(xo.to(tl.float32), hi.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(xe, lo.to(xe.dtype), input_precision=PRECISION)
            part += tl.dot(xo, hi.to(xo.dtype), input_precision=PRECISION)
        s = tl.load(s_cols + k0 // GROUP, mask=nmask, other=0.0).to(tl.float32)
        acc += part * s[None, :]
    _store_tile(y_ptr, stride_ym, acc, rm, rn, mmask, nmask, M, N, SPLIT_K)


def gemv_tiles(M: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for M rows: the fp32 accumulator, the activation
    tile and the converted weight tile stay in registers (checked by the compile report; fp32
    activations take the FMA path, which needs narrow K tiles). int4 takes the largest power of
    two <= BLOCK_K that divides its group size."""
    block_m = min(64, max(16, next_pow2(M)))
    if dtype == torch.float32:
        return block_m, 32, 32, 4 if block_m <= 16 else 8
    return block_m, 64, 64, 4 if block_m <= 32 else 8


def plan_split_k(tiles: int, K: int, block_k: int, device: torch.device) -> tuple[int, int]:
    """(split_k, k_per_split): split K when the output tiles leave SMs idle, into about two
    programs per SM, each at least 4 K tiles long. k_per_split is a multiple of block_k."""
    want = triton.cdiv(2 * num_sms(device), tiles) if tiles < num_sms(device) else 1
    split = max(1, min(want, 16, K // (4 * block_k)))
    per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    return triton.cdiv(K, per), per


def _launch(kernel, x: torch.Tensor, weight_args: tuple, N: int, K: int, group: int | None,
            out_dtype: torch.dtype, **constexprs) -> torch.Tensor:
    """Tiles, split-K plan, the GEMV launch, and the split-K sum when K is split."""
    M = x.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    BLOCK_M, BLOCK_N, block_k, warps = gemv_tiles(M, x.dtype)
    if group is not None:
        block_k = min(block_k, group & -group)
    tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(M, BLOCK_M)
    split, per = plan_split_k(tiles, K, block_k, x.device)
    dest = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M), split)](
        x, x.stride(0), *weight_args, dest, y.stride(0), M, N, K, per,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k, SPLIT_K=split > 1,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_F32=interpreter_dot_f32(kernel, x.dtype), num_warps=warps, num_stages=3, **constexprs)
    if split > 1:
        BLOCK = min(1024, next_pow2(N))
        _split_k_sum_kernel[(M, triton.cdiv(N, BLOCK))](dest, y, y.stride(0), M, N, split,
                                                        BLOCK=BLOCK, num_warps=4)
    return y


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ (q * scale)^T. x: [M, K] float (last dim contiguous); q: int8 [N, K] contiguous;
    scale: [N] float (fp32). Returns [M, N] in out_dtype (default x's dtype; e.g. fp32 logits
    from bf16 activations: the accumulation is fp32 either way)."""
    op = "int8_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    M, K = x.shape
    check_tensor(op, "q", q, shape=(None, K), dtypes=(torch.int8,), contiguous=True)
    N = q.shape[0]
    check_tensor(op, "scale", scale, shape=(N,), dtypes=FLOAT_DTYPES, contiguous=True)
    check_devices(op, _int8_linear_kernel, x=x, q=q, scale=scale)
    return _launch(_int8_linear_kernel, x, (q, q.stride(0), scale), N, K, None, out_dtype or x.dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """y = x @ dequantize_int4(packed, scales)^T. x: [M, K] float (last dim contiguous);
    packed: uint8 [N, K // 2] contiguous; scales: [N, K // group_size] float, contiguous;
    group_size: a multiple of 32 dividing K (e.g. 32, 64, 96, 128, 256; K tiles are a power of
    two dividing it, so one tile never straddles two groups, and >= 32: 16 packed bytes for
    tl.dot). Returns [M, N] in x's dtype."""
    op = "int4_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    M, K = x.shape
    G = int(group_size)
    if G < 32 or G % 32 or K % G:
        raise ValueError(f"{op}: group_size must be a multiple of 32 dividing K={K}; got {group_size}")
    check_tensor(op, "packed", packed, shape=(None, K // 2), dtypes=(torch.uint8,), contiguous=True)
    N = packed.shape[0]
    check_tensor(op, "scales", scales, shape=(N, K // G), dtypes=FLOAT_DTYPES, contiguous=True)
    check_devices(op, _int4_linear_kernel, x=x, packed=packed, scales=scales)
    return _launch(_int4_linear_kernel, x, (packed, packed.stride(0), scales, scales.stride(0)),
                   N, K, G, x.dtype, GROUP=G)
