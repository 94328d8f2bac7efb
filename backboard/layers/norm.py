"""RMSNorm modules (fp32 math, cast back); a Triton kernel on the GPU (ops/dispatch)."""

from __future__ import annotations

import torch
from torch import nn

from backboard.ops import dispatch


class RMSNorm(nn.Module):
    """zero_centered=True: Qwen3.5 Norm0, y = x_hat * (1 + w), weights stored near 0."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, zero_centered: bool) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return dispatch.rms_norm(x, self.weight, self.eps, self.zero_centered)
        return dispatch.fused_add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)
