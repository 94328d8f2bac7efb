"""Causal depthwise conv1d with a cached window (the GDN short convolution), then SiLU.

Conv state per slot: the last K-1 inputs, time-major: [num_slots, K-1, C] in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _conv_windows(xx: torch.Tensor, weight: torch.Tensor, L: int) -> torch.Tensor:
    """xx: [..., K-1+L, C], weight: [C, K] -> y [..., L, C] (fp32 accumulate, no activation)."""
    K = weight.shape[1]
    w = weight.float()
    y = xx[..., 0:L, :].float() * w[:, 0]
    for j in range(1, K):
        y = y + xx[..., j:j + L, :].float() * w[:, j]
    return y


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         cu_seqlens: list[int], slots: torch.Tensor,
                         has_initial_state: list[bool]) -> torch.Tensor:
    """Prefill spans. x: [T, C]; weight: [C, K]; conv_state: [num_slots, K-1, C], read (where
    has_initial_state, else zeros) and written with each span's last K-1 inputs.
    Returns silu(conv(x)): [T, C] in x's dtype."""
    K = weight.shape[1]
    out = torch.empty_like(x)
    for i in range(len(cu_seqlens) - 1):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        slot = slots[i]
        init = conv_state[slot] if has_initial_state[i] else torch.zeros_like(conv_state[slot])
        xx = torch.cat([init.to(x.dtype), x[s:e]], dim=0)        # [K-1+L, C]
        out[s:e] = F.silu(_conv_windows(xx, weight, e - s)).to(x.dtype)
        conv_state[slot] = xx[-(K - 1):].to(conv_state.dtype)
    return out


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         src_slots: torch.Tensor, dst_slots: torch.Tensor,
                         has_initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """Decode / verify. x: [B, L, C]; conv_state: [num_slots, K-1, C];
    src_slots: [B]; dst_slots: [B] (window after the last token) or [B, L] (window after every
    position, for speculative verification). Returns silu(conv(x)): [B, L, C]."""
    B, L, C = x.shape
    K = weight.shape[1]
    init = conv_state[src_slots].to(x.dtype)                      # [B, K-1, C]
    if has_initial_state is not None:
        init = torch.where(has_initial_state[:, None, None], init, torch.zeros_like(init))
    xx = torch.cat([init, x], dim=1)                              # [B, K-1+L, C]
    y = F.silu(_conv_windows(xx, weight, L)).to(x.dtype)
    if dst_slots.dim() == 2:
        for t in range(L):
            conv_state[dst_slots[:, t]] = xx[:, t + 1:t + K].to(conv_state.dtype)
    else:
        conv_state[dst_slots] = xx[:, L:L + K - 1].to(conv_state.dtype)
    return y
