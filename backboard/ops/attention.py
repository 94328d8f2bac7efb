"""Paged attention over block tables (torch reference / CPU path).

KV cache per attention layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of a request lives in slot block_table[p // block_size] * block_size
+ p % block_size."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, nkv, D] -> caches at slot_mapping [T] (padding rows point at a scratch slot)."""
    nkv, D = k.shape[1:]
    kf = k_cache.view(-1, nkv, D)
    vf = v_cache.view(-1, nkv, D)
    kf.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    vf.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """cache [nb, bs, nkv, D], block_table [B, >=num_blocks] -> [B, num_blocks * bs, nkv, D]."""
    g = cache[block_table[:, :num_blocks].long()]          # [B, nblk, bs, nkv, D]
    return g.reshape(g.shape[0], -1, *g.shape[3:])


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                               scale: float) -> torch.Tensor:
    """B requests with L query rows each (decode: L = 1; verify: L = 1 + k), queries being the
    last L positions of each request. q: [B, L, nh, D]; seq_lens: [B] total lengths including
    the L new tokens (already written to the cache). Returns [B, L, nh, D]."""
    B, L, nh, D = q.shape
    bs = k_cache.shape[1]
    nblk = (max_seq_len + bs - 1) // bs
    k = _gather_blocks(k_cache, block_table, nblk)          # [B, S, nkv, D]
    v = _gather_blocks(v_cache, block_table, nblk)
    S = k.shape[1]
    pos = torch.arange(S, device=q.device)
    # row j of request b sees keys at positions < seq_len - L + j + 1
    limit = seq_lens.to(q.device)[:, None] - L + 1 + torch.arange(L, device=q.device)[None, :]
    mask = pos[None, None, :] < limit[:, :, None]           # [B, L, S]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None], scale=scale, enable_gqa=nh != k.shape[2])
    return out.transpose(1, 2)


def paged_attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table_row: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """One request's span of L new tokens at the end of a sequence of seq_len tokens (the earlier
    ones from the cache). q: [L, nh, D]. Returns [L, nh, D]."""
    L, nh, D = q.shape
    bs = k_cache.shape[1]
    nblk = (seq_len + bs - 1) // bs
    k = _gather_blocks(k_cache, block_table_row[None], nblk)[0, :seq_len]   # [S, nkv, D]
    v = _gather_blocks(v_cache, block_table_row[None], nblk)[0, :seq_len]
    ctx = seq_len - L
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype)
    gqa = nh != k.shape[1]
    if ctx == 0:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.ones(L, seq_len, dtype=torch.bool, device=q.device).tril(ctx)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  ctx: int = 0) -> torch.Tensor:
    """Plain causal attention of L queries over S = ctx + L keys, fp32 (test oracle).
    q: [L, nh, D]; k, v: [S, nkv, D]."""
    L, nh, D = q.shape
    r = nh // k.shape[1]
    k = k.float().repeat_interleave(r, dim=1)
    v = v.float().repeat_interleave(r, dim=1)
    s = torch.einsum("lhd,shd->hls", q.float(), k) * scale
    mask = torch.ones(L, k.shape[0], dtype=torch.bool).tril(ctx)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hls,shd->lhd", s.softmax(-1), v)
