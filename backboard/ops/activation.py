"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] gate | up -> silu(gate) * up [T, I] (as layers.mlp.MLP)."""
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]
