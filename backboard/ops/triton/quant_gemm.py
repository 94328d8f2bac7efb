"""Weight-only int8 / int4 matmul for small M (decode GEMV up to a few hundred rows), fp32
accumulation. Formats: see backboard/ops/quant.py (int8 [N, K] + fp32 scale [N]; int4 packed
uint8 [N, K // 2], low nibble = even k, high nibble = odd k, value = nibble - 8, scales
[N, K // G]).

Grid (N / BLOCK_N, M / BLOCK_M); each program walks K in BLOCK_K tiles, converts the integer
weights to the activation dtype (exact: |q| <= 127) and uses tl.dot with an fp32 accumulator.
int4 splits each tile into its even and odd columns (the low and high nibbles), so no
interleave is needed, and applies the group scale per tile (BLOCK_K divides G).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backboard.ops.triton._checks import FLOAT_DTYPES, check_devices, check_tensor, interpreter_dot_f32, next_pow2


@triton.jit
def _int8_linear_kernel(
    x_ptr, stride_xm, q_ptr, stride_qn, s_ptr, y_ptr, stride_ym, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask = rn < N
    mmask = rm < M
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    q_cols = q_ptr + rn.to(tl.int64)[None, :] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(q_cols + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    s = tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    y = acc * s[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _int4_linear_kernel(
    x_ptr, stride_xm, p_ptr, stride_pn, s_ptr, stride_sn, y_ptr, stride_ym, M, N, K,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask = rn < N
    mmask = rm < M
    rj = tl.arange(0, BLOCK_K // 2)                    # packed bytes of one K tile
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    p_cols = p_ptr + rn.to(tl.int64)[None, :] * stride_pn
    s_cols = s_ptr + rn.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):                    # K % BLOCK_K == 0, BLOCK_K divides GROUP
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
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _tiles(M: int) -> tuple[int, int]:
    block_m = min(64, max(16, next_pow2(M)))
    block_n = 64 if block_m <= 32 else 128
    return block_m, block_n


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ (q * scale)^T. x: [M, K] float (last dim contiguous); q: int8 [N, K] contiguous;
    scale: [N] float (fp32). Returns [M, N] in x's dtype."""
    op = "int8_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    M, K = x.shape
    check_tensor(op, "q", q, shape=(None, K), dtypes=(torch.int8,), contiguous=True)
    N = q.shape[0]
    check_tensor(op, "scale", scale, shape=(N,), dtypes=FLOAT_DTYPES, contiguous=True)
    check_devices(op, _int8_linear_kernel, x=x, q=q, scale=scale)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    BLOCK_M, BLOCK_N = _tiles(M)
    BLOCK_K = 128
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))
    _int8_linear_kernel[grid](x, x.stride(0), q, q.stride(0), scale, y, y.stride(0), M, N, K,
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                              DOT_F32=interpreter_dot_f32(_int8_linear_kernel, x.dtype),
                              num_warps=4, num_stages=3)
    return y


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """y = x @ dequantize_int4(packed, scales)^T. x: [M, K] float (last dim contiguous);
    packed: uint8 [N, K // 2] contiguous; scales: [N, K // group_size] float, contiguous;
    group_size: a multiple of 32 that divides K (and, above 128, a multiple of 128).
    Returns [M, N] in x's dtype."""
    op = "int4_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    M, K = x.shape
    G = int(group_size)
    if G < 32 or G % 32 or K % G or (G > 128 and G % 128):
        raise ValueError(f"{op}: group_size must be a multiple of 32 dividing K={K} (a multiple "
                         f"of 128 when above 128); got {group_size}")
    check_tensor(op, "packed", packed, shape=(None, K // 2), dtypes=(torch.uint8,), contiguous=True)
    N = packed.shape[0]
    check_tensor(op, "scales", scales, shape=(N, K // G), dtypes=FLOAT_DTYPES, contiguous=True)
    check_devices(op, _int4_linear_kernel, x=x, packed=packed, scales=scales)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    BLOCK_M, BLOCK_N = _tiles(M)
    BLOCK_K = min(G, 128)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))
    _int4_linear_kernel[grid](x, x.stride(0), packed, packed.stride(0), scales, scales.stride(0),
                              y, y.stride(0), M, N, K, GROUP=G, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                              BLOCK_K=BLOCK_K, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                              DOT_F32=interpreter_dot_f32(_int4_linear_kernel, x.dtype),
                              num_warps=4, num_stages=3)
    return y
