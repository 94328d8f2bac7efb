"""Paged decode attention over block tables, with GQA and L query rows per request.

B requests, each with L query rows being the last L positions of its sequence (decode: L = 1;
verify: L = 1 + k draft rows). Row t of request b sees the keys at positions
< seq_lens[b] - L + 1 + t (the causal limit per row). KV cache per layer:
k_cache, v_cache [num_blocks, block_size, nkv, D]; position p of request b lives at
block_table[b, p // block_size], offset p % block_size.

`_paged_attention_decode_kernel`, grid (B * nkv * row_tiles, num_splits): one program takes one
KV head of one request and BLOCK_M of the r * L query rows that share it (r = nh / nkv query heads
x L rows; one tl.dot tile, so every K/V block is read once per KV head when r * L <= BLOCK_M, and
once per row tile beyond: BLOCK_M is capped to keep the fp32 accumulator in registers). Each
request's context is split into `num_splits` contiguous ranges (flash-decoding) of
cdiv(seq_len, num_splits) keys rounded up to BLOCK_N, computed in the kernel from seq_lens: the
split follows each request's real length, also inside a CUDA graph captured once per batch size.
Each program keeps an online softmax (running max m, sum l, fp32 accumulator) over its range.
With one split it writes the output directly; otherwise it writes (acc, m, l) partials and
`_paged_attention_reduce_kernel` (grid B * L * nh) merges the ranges a request used. The split
count depends on the batch and the SM count only, and is a runtime argument: as contexts grow
nothing is recompiled (only split / no split, and the row tile, are compiled separately).
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

# runtime ints that change from step to step are not specialised (Triton would compile again
# when one becomes 1 or a multiple of 16), nor is the alignment of the per-step index tensors
# (slices of the step's arrays at any request offset)
# (the block table's width is the step's longest request in blocks)
_VARYING = dict(do_not_specialize=["stride_bt", "L", "NUM_SPLITS"],
                do_not_specialize_on_alignment=["bt_ptr", "seq_lens_ptr"])


@triton.jit(**_VARYING)
def _paged_attention_decode_kernel(
    q_ptr, sq_b, sq_l, sq_h,                  # [B, L, nh, D], D stride 1
    k_ptr, v_ptr, sk_blk, sk_tok, sk_head,    # caches [num_blocks, bs, nkv, D], D stride 1
    bt_ptr, stride_bt,                        # block_table [B, M]
    seq_lens_ptr,                             # [B]
    out_ptr, so_b, so_l, so_h,                # [B, L, nh, D] (when not SPLIT)
    po_ptr, pm_ptr, pl_ptr,                   # partials [B, L, nh, S, D], [B, L, nh, S] x 2
    L, NKV, scale, NUM_SPLITS,
    R: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    row_tiles = tl.cdiv(L * R, BLOCK_M)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rt = pid % row_tiles
    b = pid // row_tiles // NKV
    kvh = pid // row_tiles % NKV
    m = rt * BLOCK_M + tl.arange(0, BLOCK_M)  # tile row m = query row t, head kvh*R + i
    t = m // R
    h = kvh * R + m % R
    mvalid = m < L * R
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    if start < seq_len:                        # splits past this request's length: nothing
        q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_l + h[:, None] * sq_h + d[None, :],
                    mask=mvalid[:, None] & dmask[None, :], other=0.0)
        limit = seq_len - L + 1 + t            # row t sees positions < limit
        end = tl.minimum(start + tokens_per_split, seq_len)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < end
            blk = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=pmask, other=0).to(tl.int64)
            tok = blk * sk_blk + (pos % BS) * sk_tok + kvh * sk_head      # [BLOCK_N]
            kT = tl.load(k_ptr + tok[None, :] + d[:, None], mask=dmask[:, None] & pmask[None, :],
                         other=0.0)                                      # [BLOCK_D, BLOCK_N]
            if DOT_F32:
                s = tl.dot(q.to(tl.float32), kT.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, kT.to(q.dtype), input_precision=PRECISION)
            s = s * scale                                                # [BLOCK_M, BLOCK_N]
            visible = (pos[None, :] < limit[:, None]) & pmask[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + tok[:, None] + d[None, :], mask=pmask[:, None] & dmask[None, :],
                        other=0.0)                                       # [BLOCK_N, BLOCK_D]
            if DOT_F32:
                pv = tl.dot(p.to(q.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if not SPLIT:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + b * so_b + t[:, None] * so_l + h[:, None] * so_h + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=mvalid[:, None] & dmask[None, :])
        else:
            prow = ((b * L + t) * (NKV * R) + h) * NUM_SPLITS + split   # [B, L, nh, S] row
            tl.store(po_ptr + prow[:, None] * D + d[None, :], acc,
                     mask=mvalid[:, None] & dmask[None, :])
            tl.store(pm_ptr + prow, m_i, mask=mvalid)
            tl.store(pl_ptr + prow, l_i, mask=mvalid)


@triton.jit(do_not_specialize=["L", "NUM_SPLITS"], do_not_specialize_on_alignment=["seq_lens_ptr"])
def _paged_attention_reduce_kernel(
    po_ptr, pm_ptr, pl_ptr,                   # [R, S, D], [R, S], [R, S] with R = B*L*nh
    seq_lens_ptr,                             # [B]
    out_ptr, NH, so_b, so_l, so_h, L, NUM_SPLITS,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // (L * NH)
    t = (row // NH) % L
    h = row % NH
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    used = tl.cdiv(seq_len, tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N)
    base = row.to(tl.int64) * NUM_SPLITS
    # online merge, one split at a time: no tile over the splits, so no recompile as they change
    m_run = tl.full([1], float("-inf"), dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(used):
        m_i = tl.load(pm_ptr + base + i)
        m_new = tl.maximum(m_run, m_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        keep = tl.exp(m_run - m_safe)
        w = tl.exp(m_i - m_safe)                           # 0 for a range this row cannot see
        acc = acc * keep + w * tl.load(po_ptr + (base + i) * D + d, mask=dmask, other=0.0)
        den = den * keep + w * tl.load(pl_ptr + base + i)
        m_run = m_new
    den = tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * so_b + t * so_l + h * so_h + d, (acc / den).to(out_ptr.dtype.element_ty),
             mask=dmask)


def _launch_reduce(po: torch.Tensor, pm: torch.Tensor, pl: torch.Tensor, seq_lens: torch.Tensor,
                   out: torch.Tensor, block_n: int) -> None:
    """Merge split partials po [B, L, nh, S, D], pm / pl [B, L, nh, S] (fp32) into out
    [B, L, nh, D]; the ranges each request used follow from seq_lens, S and block_n."""
    B, L, nh, S, D = po.shape
    _paged_attention_reduce_kernel[(B * L * nh,)](
        po, pm, pl, seq_lens, out, nh, out.stride(0), out.stride(1), out.stride(2), L, S,
        D=D, BLOCK_N=block_n, BLOCK_D=next_pow2(D), num_warps=4)


MAX_SPLITS = 64


def plan_splits(batch: int, num_kv_heads: int, device: torch.device, row_tiles: int = 1) -> int:
    """Context splits per request: about two waves of programs over the SMs, at most MAX_SPLITS.
    Independent of the context (each request's split length follows its own seq_len in the
    kernel), so a graph captured for a batch size serves every context."""
    want = triton.cdiv(2 * num_sms(device), max(1, batch * num_kv_heads * row_tiles))
    return max(1, min(MAX_SPLITS, want))


def decode_tiles(L: int, r: int, D: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) for L rows x r heads of dim D. The fp32 accumulator
    [BLOCK_M, BLOCK_D] and the K/V tiles [BLOCK_N, BLOCK_D] must stay in registers: BLOCK_M is at
    most 32 (more rows take more row tiles), 8 warps hold a 32 x 256 accumulator, and fp32 (FMA
    dots) takes narrower key tiles. Checked by the compile report (no spills, >= 8 warps / SM)."""
    BLOCK_D = next_pow2(D)
    BLOCK_M = min(max(16, next_pow2(L * r)), 32)
    if dtype == torch.float32:
        BLOCK_N = 16 if BLOCK_D >= 128 else 32
    else:                                      # (64 keys at D = 32 spill a few bytes on sm_90)
        BLOCK_N = 64 if 64 <= BLOCK_D <= 128 else 32
    warps = 8 if BLOCK_M * BLOCK_D >= (2048 if dtype == torch.float32 else 8192) else 4
    return BLOCK_M, BLOCK_N, BLOCK_D, warps


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Same contract as ops.attention.paged_attention_decode_ref.

    q: [B, L, nh, D] (last dim contiguous); k_cache, v_cache: [num_blocks, block_size, nkv, D]
    (same strides, last dim contiguous); block_table: [B, >= cdiv(max_seq_len, block_size)]
    int32/int64; seq_lens: [B] total lengths including the L new tokens (already in the cache),
    each <= max_seq_len; scale: softmax scale. num_splits: context splits per request (None:
    planned from the batch and the SM count, see plan_splits).
    Returns [B, L, nh, D] in q's dtype (fp32 softmax and accumulation)."""
    B, L, nh, D = q.shape
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    _check_decode(q, k_cache, v_cache, block_table, seq_lens, max_seq_len)
    BLOCK_M, BLOCK_N, BLOCK_D, warps = decode_tiles(L, nh // nkv, D, q.dtype)
    row_tiles = triton.cdiv(L * (nh // nkv), BLOCK_M)
    if num_splits is None:
        num_splits = plan_splits(B, nkv, q.device, row_tiles)
    if num_splits < 1:
        raise ValueError(f"paged_attention_decode: num_splits must be >= 1, got {num_splits}")
    out = torch.empty(B, L, nh, D, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        po = torch.empty(B, L, nh, num_splits, D, dtype=torch.float32, device=q.device)
        pm = torch.empty(B, L, nh, num_splits, dtype=torch.float32, device=q.device)
        pl = torch.empty(B, L, nh, num_splits, dtype=torch.float32, device=q.device)
    else:
        po = pm = pl = out
    precision = "ieee" if q.dtype == torch.float32 else "tf32"      # (tf32 only names the bf16 path)
    _paged_attention_decode_kernel[(B * nkv * row_tiles, num_splits)](
        q, q.stride(0), q.stride(1), q.stride(2),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table, block_table.stride(0), seq_lens,
        out, out.stride(0), out.stride(1), out.stride(2), po, pm, pl,
        L, nkv, float(scale), num_splits,
        R=nh // nkv, D=D, BS=bs, SPLIT=num_splits > 1, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D, PRECISION=precision,
        DOT_F32=interpreter_dot_f32(_paged_attention_decode_kernel, q.dtype), num_warps=warps,
        num_stages=2)
    if num_splits > 1:
        _launch_reduce(po, pm, pl, seq_lens, out, BLOCK_N)
    return out


def _check_decode(q, k_cache, v_cache, block_table, seq_lens, max_seq_len: int) -> None:
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
    check_devices(op, _paged_attention_decode_kernel, q=q, k_cache=k_cache, v_cache=v_cache,
                  block_table=block_table, seq_lens=seq_lens)
