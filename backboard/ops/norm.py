"""RMS norms, computed in fp32 and cast back to the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w)  (zero-centred, Qwen3.5 Norm0) or * w (plain)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    y = y * (1.0 + w) if zero_centered else y * w
    return y.to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """The GDN output norm: rmsnorm(x) * w * silu(gate), per head over the last dim (plain w).

    As in transformers, the normalised x is rounded to the model dtype before the weight."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(out_dtype)
    y = weight * y
    return (y.float() * F.silu(gate.float())).to(out_dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + residual (in the model dtype, as `h = h + x`); returns (rms_norm_ref(r), r).
    x, residual: [..., N]; weight: [N]."""
    r = x + residual
    return rms_norm_ref(r, weight, eps, zero_centered), r
