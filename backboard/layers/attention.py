"""Paged attention over the flat batch: writes the new K/V into the layer's cache, then attends
each request's queries over its whole context (cache + new tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backboard.forward_context import get_forward_context
from backboard.layers.rows import join_rows
from backboard.ops import dispatch
from backboard.ops.attention import write_kv


@dataclass(frozen=True)
class QKNormRope:
    """The per-head q / k RMSNorm and RoPE, run with the cache write (one kernel on the GPU)."""

    q_weight: torch.Tensor | None           # [D]; None: no q / k norm (RoPE alone)
    k_weight: torch.Tensor | None           # [D]
    eps: float
    zero_centered: bool
    inv_freq: torch.Tensor                  # [rotary_dim / 2] fp32
    positions: torch.Tensor                 # [T]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, attn_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.attn_idx = attn_idx            # ordinal among the attention layers (KV cache index)
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                prologue: QKNormRope | None = None) -> torch.Tensor:
        """q [T, nh, D], k/v [T, nkv, D] -> [T, nh, D]. With a prologue, q and k come raw (not
        normed, not rotated) and are normed and rotated as k and v go into the cache."""
        ctx = get_forward_context()
        meta = ctx.meta
        k_cache, v_cache = ctx.caches.k[self.attn_idx], ctx.caches.v[self.attn_idx]
        if prologue is None:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            p = prologue
            q = dispatch.qk_norm_rope_write_kv(q, k, v, p.q_weight, p.k_weight, p.eps,
                                               p.zero_centered, p.positions, p.inv_freq, k_cache,
                                               v_cache, meta.slot_mapping)
        parts = []                          # outputs in token order (groups, then prefills)
        for g in meta.groups:
            rs, re = g.req_start, g.req_end
            qg = q[g.tok_start:g.tok_end].view(g.num_reqs, g.L, self.num_heads, self.head_dim)
            max_len = int(meta.seq_lens_cpu[rs:re].max())
            og = dispatch.paged_attention_decode(qg, k_cache, v_cache, meta.block_table[rs:re],
                                                 meta.seq_lens[rs:re], max_len, self.scale)
            parts.append((g.tok_start, og.reshape(-1, self.num_heads, self.head_dim)))
        qsl = meta.query_start_loc_cpu
        for r in range(meta.prefill_start, meta.num_reqs):
            s, e = int(qsl[r]), int(qsl[r + 1])
            parts.append((s, dispatch.paged_attention_prefill(q[s:e], k_cache, v_cache, meta.block_table[r],
                                                              int(meta.seq_lens_cpu[r]), self.scale)))
        return join_rows(parts, q.shape[0])

