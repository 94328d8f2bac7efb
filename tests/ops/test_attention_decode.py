"""Paged decode attention (Triton, split-K + reduce) against ops.attention.paged_attention_decode_ref."""

from __future__ import annotations

import pytest
import torch

from backboard.ops.attention import paged_attention_decode_ref
from backboard.ops.triton import attention as ta


def make_inputs(B, L, nh, nkv, D, bs, seq_lens, dtype, num_blocks=48):
    k_cache = torch.randn(num_blocks, bs, nkv, D).to(dtype)
    v_cache = torch.randn(num_blocks, bs, nkv, D).to(dtype)
    max_len = max(seq_lens)
    per_req = -(-max_len // bs) + 1                                  # one spare column
    perm = torch.randperm(num_blocks)[:B * per_req]                  # scattered blocks
    block_table = perm.view(B, per_req).to(torch.int32)
    q = torch.randn(B, L, nh, D).to(dtype)
    return q, k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), max_len


CASES = [
    # B, L, nh, nkv, D, bs, seq_lens, num_splits
    (3, 1, 4, 2, 16, 4, [5, 37, 1], None),       # decode, r=2, a 1-token sequence, planned splits
    (2, 3, 6, 2, 24, 8, [3, 29], 3),             # verify rows, r=3, D=24, seq_len == L, 3 splits
    (2, 4, 2, 2, 32, 16, [20, 33], 1),           # r=1, one split (direct write)
    (2, 2, 4, 1, 16, 4, [6, 9], 8),              # MQA (r=4), more splits than the short one needs
    (2, 9, 8, 2, 16, 4, [12, 40], 3),            # 36 rows per KV head: two row tiles of 32
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["decode", "verify-split3", "nosplit", "mqa-split8",
                                            "row-tiles"])
def test_paged_attention_decode_matches_reference(case, dtype, close):
    B, L, nh, nkv, D, bs, seq_lens, splits = case
    q, kc, vc, bt, seq, max_len = make_inputs(B, L, nh, nkv, D, bs, seq_lens, dtype)
    ref = paged_attention_decode_ref(q, kc, vc, bt, seq, max_len, D ** -0.5)
    out = ta.paged_attention_decode(q, kc, vc, bt, seq, max_len, D ** -0.5, num_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    close(out, ref, dtype)


def test_int64_block_table_and_strided_query(close):
    """q as a view with padded head stride (last dim contiguous), int64 block table."""
    q, kc, vc, bt, seq, max_len = make_inputs(2, 2, 4, 2, 16, 4, [7, 13], torch.float32)
    qbig = torch.randn(2, 2, 4, 32)
    qbig[..., :16] = q
    qv = qbig[..., :16]
    out = ta.paged_attention_decode(qv, kc, vc, bt.long(), seq.long(), max_len, 0.25, num_splits=2)
    close(out, paged_attention_decode_ref(q, kc, vc, bt, seq, max_len, 0.25))


def test_comparison_catches_wrong_causal_limit_and_gqa(differs):
    B, L, nh, nkv, D = 2, 3, 4, 2, 16
    q, kc, vc, bt, seq, max_len = make_inputs(B, L, nh, nkv, D, 4, [9, 14], torch.float32)
    out = ta.paged_attention_decode(q, kc, vc, bt, seq, max_len, D ** -0.5, num_splits=2)
    # every row seeing the whole sequence (no per-row causal limit)
    no_causal = torch.cat([paged_attention_decode_ref(q[:, t:t + 1], kc, vc, bt, seq, max_len, D ** -0.5)
                           for t in range(L)], dim=1)
    differs(out, no_causal)
    # query head h reading KV head h % nkv instead of h // r: permute heads around the reference
    r = nh // nkv
    pi = torch.tensor([(h % nkv) * r + h // nkv for h in range(nh)])
    qp = torch.empty_like(q)
    qp[:, :, pi] = q
    wrong = paged_attention_decode_ref(qp, kc, vc, bt, seq, max_len, D ** -0.5)[:, :, pi]
    differs(out, wrong)


def test_plan_splits():
    cpu = torch.device("cpu")                                        # stands in for 4 SMs
    assert ta.plan_splits(1, 1, cpu) == 8                            # 2 waves over 4 "SMs"
    assert ta.plan_splits(1, 2, cpu, row_tiles=2) == 2
    assert ta.plan_splits(64, 4, cpu) == 1                           # the batch fills the GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_splits_follow_each_requests_length(dtype, close, monkeypatch):
    """A CUDA graph captures the attention for the longest context (max_seq_len) with a fixed
    split count; the split ranges must follow each request's real length (seq_lens on the
    device), so that a short context still spreads over every split instead of filling one."""
    B, L, nh, nkv, D, bs = 2, 2, 4, 2, 32, 16
    seq_lens, max_len, S = [300, 137], 4096, 8
    q, kc, vc, bt, seq, _ = make_inputs(B, L, nh, nkv, D, bs, seq_lens, dtype, num_blocks=64)
    bt = torch.cat([bt, bt[:, :1].expand(B, max_len // bs - bt.shape[1])], dim=1)   # graph-wide table
    seen = {}
    real, empty = ta._launch_reduce, torch.empty

    def poisoned(*a, **k):               # unwritten partials stay NaN
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def spy(po, pm, pl, seq_lens_, out, block_n):
        seen.update(pm=pm.clone(), block_n=block_n)
        return real(po, pm, pl, seq_lens_, out, block_n)

    monkeypatch.setattr(ta, "_launch_reduce", spy)
    monkeypatch.setattr(torch, "empty", poisoned)
    out = ta.paged_attention_decode(q, kc, vc, bt, seq, max_len, D ** -0.5, num_splits=S)
    close(out, paged_attention_decode_ref(q, kc, vc, bt, seq, max_len, D ** -0.5), dtype)
    bn = seen["block_n"]
    for b, n in enumerate(seq_lens):
        per_split = -(-(-(-n // S)) // bn) * bn  # noqa: B002 - ceil(ceil(n / S) / bn) * bn
        worked = torch.isfinite(seen["pm"][b, -1, 0]).sum().item()    # the last row sees every key
        assert torch.isnan(seen["pm"][b, -1, 0, worked:]).all()          # the rest: not written
        assert worked == -(-n // per_split) > 1, (b, worked)
