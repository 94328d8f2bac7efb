"""Paged decode attention over block tables, with GQA and L query rows per request.

B requests, each with L query rows being the last L positions of its sequence (decode: L = 1;
verify: L = 1 + k draft rows). Row t of request b sees the keys at positions
< seq_lens[b] - L + 1 + t (the causal limit per row). KV cache per layer:
k_cache, v_cache [num_blocks, block_size, nkv, D]; position p of request b lives at
block_table[b, p // block_size], offset p % block_size.

`_paged_attention_decode_kernel`, grid (B * nkv, num_splits): one program takes one KV head of
one request and all r * L query rows that share it (r = nh / nkv query heads x L rows, one
tl.dot tile), so every K/V block is read once per KV head. The context is split into
`num_splits` contiguous ranges (flash-decoding) so that small batches still fill the GPU; each
program keeps an online softmax (running max m, sum l, fp32 accumulator) over its range.
With one split it writes the output directly; otherwise it writes (acc, m, l) partials and
`_paged_attention_reduce_kernel` (grid B * L * nh) merges them. The split count is a runtime
argument (no recompilation as contexts grow); only split / no split is compiled separately.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backboard.ops.triton._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_tensor,
    interpreter_dot_f32,
    next_pow2,
    num_sms,
)


@triton.jit
def _paged_attention_decode_kernel(
    q_ptr, sq_b, sq_l, sq_h,                  # [B, L, nh, D], D stride 1
    k_ptr, v_ptr, sk_blk, sk_tok, sk_head,    # caches [num_blocks, bs, nkv, D], D stride 1
    bt_ptr, stride_bt,                        # block_table [B, M]
    seq_lens_ptr,                             # [B]
    out_ptr, so_b, so_l, so_h,                # [B, L, nh, D] (when NUM_SPLITS == 1)
    po_ptr, pm_ptr, pl_ptr,                   # partials [B, L, nh, S, D], [B, L, nh, S] x 2
    L, NH, NKV, scale, tokens_per_split, NUM_SPLITS,
    R: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // NKV
    kvh = pid % NKV
    m = tl.arange(0, BLOCK_M)                 # tile row m = query row t, head kvh*R + i
    t = m // R
    h = kvh * R + m % R
    mvalid = m < L * R
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_l + h[:, None] * sq_h + d[None, :],
                mask=mvalid[:, None] & dmask[None, :], other=0.0)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    limit = seq_len - L + 1 + t                # row t sees positions < limit
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        blk = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=pmask, other=0).to(tl.int64)
        tok = blk * sk_blk + (pos % BS) * sk_tok + kvh * sk_head          # [BLOCK_N]
        kT = tl.load(k_ptr + tok[None, :] + d[:, None], mask=dmask[:, None] & pmask[None, :],
                     other=0.0)                                          # [BLOCK_D, BLOCK_N]
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), kT.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kT.to(q.dtype), input_precision=PRECISION)
        s = s * scale                                                    # [BLOCK_M, BLOCK_N]
        visible = (pos[None, :] < limit[:, None]) & pmask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + tok[:, None] + d[None, :], mask=pmask[:, None] & dmask[None, :],
                    other=0.0)                                           # [BLOCK_N, BLOCK_D]
        if DOT_F32:
            pv = tl.dot(p.to(q.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    row = (b * L + t) * NH + h                 # flat [B, L, nh] row of each tile row
    if not SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * so_b + t[:, None] * so_l + h[:, None] * so_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mvalid[:, None] & dmask[None, :])
    else:
        prow = row * NUM_SPLITS + split
        tl.store(po_ptr + prow[:, None] * D + d[None, :], acc,
                 mask=mvalid[:, None] & dmask[None, :])
        tl.store(pm_ptr + prow, m_i, mask=mvalid)
        tl.store(pl_ptr + prow, l_i, mask=mvalid)


@triton.jit
def _paged_attention_reduce_kernel(
    po_ptr, pm_ptr, pl_ptr,                   # [R, S, D], [R, S], [R, S] with R = B*L*nh
    out_ptr, NH, so_b, so_l, so_h, L, NUM_SPLITS,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // (L * NH)
    t = (row // NH) % L
    h = row % NH
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    base = row.to(tl.int64) * NUM_SPLITS
    m = tl.load(pm_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    for i in range(NUM_SPLITS):                # one split at a time: registers stay [BLOCK_D]
        w = tl.exp(tl.load(pm_ptr + base + i) - m_max)        # 0 for an empty split
        acc += w * tl.load(po_ptr + (base + i) * D + d, mask=dmask, other=0.0)
        den += w * tl.load(pl_ptr + base + i)
    den = tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * so_b + t * so_l + h * so_h + d, (acc / den).to(out_ptr.dtype.element_ty),
             mask=dmask)


def paged_attention_reduce(partial_out: torch.Tensor, partial_m: torch.Tensor,
                           partial_l: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge split-K partials. partial_out: [B, L, nh, S, D] fp32 (unnormalised accumulators);
    partial_m, partial_l: [B, L, nh, S] fp32 (running max, sum of exp); out: [B, L, nh, D],
    last dim contiguous, written and returned."""
    op = "paged_attention_reduce"
    check_tensor(op, "partial_out", partial_out, ndim=5, dtypes=(torch.float32,), contiguous=True)
    B, L, nh, S, D = partial_out.shape
    check_tensor(op, "partial_m", partial_m, shape=(B, L, nh, S), dtypes=(torch.float32,), contiguous=True)
    check_tensor(op, "partial_l", partial_l, shape=(B, L, nh, S), dtypes=(torch.float32,), contiguous=True)
    check_tensor(op, "out", out, shape=(B, L, nh, D), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_devices(op, _paged_attention_reduce_kernel, partial_out=partial_out, partial_m=partial_m,
                  partial_l=partial_l, out=out)
    _paged_attention_reduce_kernel[(B * L * nh,)](
        partial_out, partial_m, partial_l, out, nh, out.stride(0), out.stride(1), out.stride(2), L, S,
        D=D, BLOCK_S=next_pow2(S), BLOCK_D=next_pow2(D), num_warps=4)
    return out


def plan_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                block_n: int = 64) -> int:
    """How many context splits: enough programs for about two waves over the SMs, each split at
    least 2 * block_n keys long."""
    want = triton.cdiv(2 * num_sms(device), max(1, batch * num_kv_heads))
    most = max(1, triton.cdiv(max_seq_len, 2 * block_n))
    return max(1, min(want, most))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Same contract as ops.attention.paged_attention_decode_ref.

    q: [B, L, nh, D] (last dim contiguous); k_cache, v_cache: [num_blocks, block_size, nkv, D]
    (same strides, last dim contiguous); block_table: [B, >= cdiv(max_seq_len, block_size)]
    int32/int64; seq_lens: [B] total lengths including the L new tokens (already in the cache),
    each <= max_seq_len; scale: softmax scale. num_splits: context splits (None: planned from
    the batch and max_seq_len; fix it when capturing CUDA graphs).
    Returns [B, L, nh, D] in q's dtype (fp32 softmax and accumulation)."""
    op = "paged_attention_decode"
    check_tensor(op, "q", q, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    B, L, nh, D = q.shape
    check_tensor(op, "k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    nb, bs, nkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"{op}: head dim of q ({D}) and k_cache ({Dk}) differ")
    check_tensor(op, "v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,),
                 last_dim_contiguous=True)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache must have the same strides, got "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    if nkv == 0 or nh % nkv:
        raise ValueError(f"{op}: num heads ({nh}) must be a multiple of num kv heads ({nkv})")
    if bs & (bs - 1):
        raise ValueError(f"{op}: block_size must be a power of two, got {bs}")
    check_tensor(op, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, last_dim_contiguous=True)
    if block_table.shape[0] != B:
        raise ValueError(f"{op}: block_table has {block_table.shape[0]} rows for B={B}")
    if block_table.shape[1] * bs < max_seq_len:
        raise ValueError(f"{op}: block_table covers {block_table.shape[1] * bs} tokens, "
                         f"fewer than max_seq_len={max_seq_len}")
    check_tensor(op, "seq_lens", seq_lens, shape=(B,), dtypes=INDEX_DTYPES, contiguous=True)
    if max_seq_len < L:
        raise ValueError(f"{op}: max_seq_len={max_seq_len} is smaller than the {L} query rows")
    dev = check_devices(op, _paged_attention_decode_kernel, q=q, k_cache=k_cache, v_cache=v_cache,
                        block_table=block_table, seq_lens=seq_lens)
    BLOCK_D = next_pow2(D)
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    BLOCK_M = max(16, next_pow2(L * nh // nkv))
    if num_splits is None:
        num_splits = plan_splits(B, nkv, max_seq_len, dev, BLOCK_N)
    if num_splits < 1:
        raise ValueError(f"{op}: num_splits must be >= 1, got {num_splits}")
    tokens_per_split = triton.cdiv(triton.cdiv(max_seq_len, num_splits), BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(max_seq_len, tokens_per_split)
    out = torch.empty(B, L, nh, D, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        po = torch.empty(B, L, nh, num_splits, D, dtype=torch.float32, device=q.device)
        pm = torch.empty(B, L, nh, num_splits, dtype=torch.float32, device=q.device)
        pl = torch.empty(B, L, nh, num_splits, dtype=torch.float32, device=q.device)
    else:
        po = pm = pl = out
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_attention_decode_kernel[(B * nkv, num_splits)](
        q, q.stride(0), q.stride(1), q.stride(2),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table, block_table.stride(0), seq_lens,
        out, out.stride(0), out.stride(1), out.stride(2), po, pm, pl,
        L, nh, nkv, float(scale), tokens_per_split, num_splits,
        R=nh // nkv, D=D, BS=bs, SPLIT=num_splits > 1, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D, PRECISION=precision,
        DOT_F32=interpreter_dot_f32(_paged_attention_decode_kernel, q.dtype), num_warps=4, num_stages=2)
    if num_splits > 1:
        paged_attention_reduce(po, pm, pl, out)
    return out
