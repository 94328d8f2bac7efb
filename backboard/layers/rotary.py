"""Rotary position embedding, NeoX rotate-half over the first `rotary_dim` dims of each head
(partial rotary); the remaining dims pass through. For text-only input Qwen3.5's interleaved
mRoPE reduces exactly to this 1-D RoPE. The math is in ops/rotary.py."""

from __future__ import annotations

import torch
from torch import nn

from backboard.ops.rotary import apply_rotary_ref, rotary_cos_sin_ref


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim] (computed in fp32, cast to dtype)."""
        return rotary_cos_sin_ref(positions, self.inv_freq, dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, h, D]; cos/sin [T, rot] -> rotated x."""
        return apply_rotary_ref(x, cos, sin)
