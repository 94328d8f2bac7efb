"""Linear layers. Weights are [out_features, in_features] in the model dtype; joined projections
(q/k/v, gate/up, the four GDN inputs) are one weight whose rows are the parts, in order."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int | list[int], dtype: torch.dtype,
                 bias: bool = False) -> None:
        super().__init__()
        self.output_sizes = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        out = sum(self.output_sizes)
        self.in_features, self.out_features = in_features, out
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Split a joined output into its parts (views)."""
        return list(torch.split(y, self.output_sizes, dim=-1))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}"
