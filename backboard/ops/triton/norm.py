"""RMS norms: plain / zero-centred RMSNorm, fused residual add + RMSNorm, and the gated RMSNorm
of the GDN output. fp32 math, rounded like the torch references in ops/norm.py (and
ops/norm.fused_add_rms_norm_ref for the residual add, which rounds x + residual to the model
dtype before normalising, as `h = h + x` does in the model)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backboard.ops.triton._checks import FLOAT_DTYPES, check_devices, check_tensor, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, stride_x, res_ptr, stride_res, out_ptr, stride_out, res_out_ptr, stride_res_out,
    w_ptr, N, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = xf * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = y * (1.0 + w)
    else:
        y = y * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(op: str, name: str, x: torch.Tensor, n: int) -> torch.Tensor:
    check_tensor(op, name, x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.dim() == 0 or x.shape[-1] != n:
        raise ValueError(f"{op}: {name} must end in a dim of {n} (the weight's size), got {tuple(x.shape)}")
    return x.reshape(-1, n)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w) (zero_centered) or * w, over the last dim.
    x: [..., N] (last dim contiguous); weight: [N]. Returns y with x's shape and dtype."""
    op = "rms_norm"
    check_tensor(op, "weight", weight, ndim=1, dtypes=FLOAT_DTYPES, contiguous=True)
    N = weight.shape[0]
    x2 = _rows(op, "x", x, N)
    check_devices(op, _rms_norm_kernel, x=x, weight=weight)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x2, None, out, None, weight, eps, zero_centered)
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + residual (rounded to residual's dtype); returns (rms_norm(r), r).
    x, residual: [..., N] same shape (last dim contiguous); weight: [N]."""
    op = "fused_add_rms_norm"
    check_tensor(op, "weight", weight, ndim=1, dtypes=FLOAT_DTYPES, contiguous=True)
    N = weight.shape[0]
    if tuple(x.shape) != tuple(residual.shape):
        raise ValueError(f"{op}: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    x2, r2 = _rows(op, "x", x, N), _rows(op, "residual", residual, N)
    if x.dtype != residual.dtype:
        raise ValueError(f"{op}: x ({x.dtype}) and residual ({residual.dtype}) must share a dtype")
    check_devices(op, _rms_norm_kernel, x=x, residual=residual, weight=weight)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x2.shape, dtype=residual.dtype, device=x.device)
    _launch_rms_norm(x2, r2, out, res_out, weight, eps, zero_centered)
    return out.view(x.shape), res_out.view(x.shape)


def _launch_rms_norm(x2: torch.Tensor, r2: torch.Tensor | None, out: torch.Tensor,
                     res_out: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     zero_centered: bool) -> None:
    """One program per row of x2 [rows, N]; with r2, also writes x2 + r2 to res_out."""
    if not x2.shape[0]:
        return
    N = weight.shape[0]
    BLOCK = next_pow2(N)
    r2 = x2 if r2 is None else r2
    res = out if res_out is None else res_out
    _rms_norm_kernel[(x2.shape[0],)](
        x2, x2.stride(0), r2, r2.stride(0), out, out.stride(0), res, res.stride(0),
        weight, N, float(eps), BLOCK=BLOCK, HAS_RESIDUAL=res_out is not None,
        ZERO_CENTERED=bool(zero_centered), num_warps=_warps(BLOCK))


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, sx_t, sx_h, g_ptr, sg_t, sg_h, w_ptr, out_ptr, so_t, so_h, NH, N, eps,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = (pid // NH).to(tl.int64)
    h = pid % NH
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * sx_t + h * sx_h + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (y * w).to(out_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(g_ptr + t * sg_t + h * sg_h + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * (z * tl.sigmoid(z))
    tl.store(out_ptr + t * so_t + h * so_h + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The GDN output norm, as ops.norm.gated_rms_norm_ref: rmsnorm(x) * w * silu(gate) per head.
    x, gate: [T, nh, N] (any float dtypes, last dim contiguous; e.g. gate a view of the joined
    projection); weight: [N] (dtype out_dtype). Returns [T, nh, N] in out_dtype (contiguous)."""
    op = "gated_rms_norm"
    check_tensor(op, "x", x, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    T, nh, N = x.shape
    check_tensor(op, "gate", gate, shape=(T, nh, N), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor(op, "weight", weight, shape=(N,), dtypes=(out_dtype,), contiguous=True)
    check_devices(op, _gated_rms_norm_kernel, x=x, gate=gate, weight=weight)
    out = torch.empty(T, nh, N, dtype=out_dtype, device=x.device)
    if T * nh:
        BLOCK = next_pow2(N)
        _gated_rms_norm_kernel[(T * nh,)](
            x, x.stride(0), x.stride(1), gate, gate.stride(0), gate.stride(1), weight,
            out, out.stride(0), out.stride(1), nh, N, float(eps), BLOCK=BLOCK, num_warps=_warps(BLOCK))
    return out
