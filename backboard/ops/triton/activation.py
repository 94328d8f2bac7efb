"""SiLU-mul (SwiGLU): [T, 2I] gate|up -> silu(gate) * up [T, I], rounded like the torch
`F.silu(gate) * up` in the model dtype (silu rounded, then the product rounded)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backboard.ops.triton._checks import FLOAT_DTYPES, check_devices, check_tensor, next_pow2


@triton.jit
def _silu_mul_kernel(x_ptr, stride_x, out_ptr, stride_out, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate columns then up columns, last dim contiguous) -> [T, I] in x's dtype."""
    op = "silu_mul"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    T, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"{op}: x must have an even last dim (gate | up), got {two_i}")
    check_devices(op, _silu_mul_kernel, x=x)
    I = two_i // 2
    out = torch.empty(T, I, dtype=x.dtype, device=x.device)
    if T and I:
        BLOCK = min(1024, next_pow2(I))
        _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](x, x.stride(0), out, out.stride(0), I,
                                                     BLOCK=BLOCK, num_warps=4)
    return out
