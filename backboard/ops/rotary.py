"""Rotary position embedding (NeoX rotate-half over the first `rotary_dim` dims of each head) and
the attention layer's per-token prologue: q / k RMSNorm, RoPE, and the K/V cache write (the torch
reference of ops/triton/rope.py)."""

from __future__ import annotations

import torch

from backboard.ops.attention import write_kv
from backboard.ops.norm import rms_norm_ref


def rotary_cos_sin_ref(positions: torch.Tensor, inv_freq: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], inv_freq [rot/2] fp32 -> cos, sin [T, rot] (computed in fp32, cast to dtype)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, h, D]; cos/sin [T, rot] -> rotated x (dims >= rot pass through)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


def qk_norm_rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                              zero_centered: bool, positions: torch.Tensor, inv_freq: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor) -> torch.Tensor:
    """q [T, nh, D], k / v [T, nkv, D] (any strides with a contiguous last dim); q_weight,
    k_weight [D], or both None for a model without q / k norm (Llama, Qwen2: RoPE alone);
    positions [T]; inv_freq [rot/2] fp32; caches [num_blocks, block_size, nkv, D];
    slot_mapping [T]. Writes rope(norm(k)) and v at slot_mapping; returns rope(norm(q))
    [T, nh, D] contiguous."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope_write_kv: q_weight and k_weight must both be given or both be None")
    if q_weight is not None:
        q = rms_norm_ref(q, q_weight, eps, zero_centered)
        k = rms_norm_ref(k, k_weight, eps, zero_centered)
    cos, sin = rotary_cos_sin_ref(positions, inv_freq, q.dtype)
    q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q.contiguous()
