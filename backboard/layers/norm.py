"""RMSNorm modules (fp32 math, cast back)."""

from __future__ import annotations

import torch
from torch import nn

from backboard.ops.norm import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """zero_centered=True: Qwen3.5 Norm0, y = x_hat * (1 + w), weights stored near 0."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, zero_centered: bool) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: rmsnorm(x) * w * silu(z), plain w (weights near 1)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps, self.dtype = eps, dtype
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps, self.dtype)
