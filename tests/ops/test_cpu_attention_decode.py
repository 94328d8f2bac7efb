"""The C++ paged decode / verify attention (ops/cpu/paged_attention.h) against
ops.attention.paged_attention_decode_ref: GQA ratios, head dims off the vector width, block sizes,
requests of different lengths, verify rows, the split-context path, bf16 and fp32 caches."""

from __future__ import annotations

import pytest
import torch

from backboard.ops.attention import paged_attention_decode_ref
from backboard.ops.cpu import decode_ops
from tests.ops.cpu_isas import built, isa_param


def make_inputs(B, L, nh, nkv, D, bs, seq_lens, dtype, num_blocks=None):
    max_len = max(seq_lens)
    per_req = -(-max_len // bs) + 1                                  # one spare column
    num_blocks = num_blocks or B * per_req + 3
    k_cache = torch.randn(num_blocks, bs, nkv, D).to(dtype)
    v_cache = torch.randn(num_blocks, bs, nkv, D).to(dtype)
    block_table = torch.randperm(num_blocks)[:B * per_req].view(B, per_req).to(torch.int32)
    q = torch.randn(B, L, nh, D).to(dtype)
    return q, k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), max_len


CASES = {
    # B, L, nh, nkv, D, bs, seq_lens
    "decode-r2": (3, 1, 4, 2, 16, 4, [5, 37, 1]),
    "decode-r3-d64": (2, 1, 6, 2, 64, 16, [70, 200]),          # 3 rows a KV head (SmolLM2's ratio)
    "verify3-r3-d24": (2, 3, 6, 2, 24, 8, [3, 29]),
    "verify4-r1-d72": (2, 4, 2, 2, 72, 16, [20, 33]),
    "verify2-mqa-d256": (2, 2, 4, 1, 256, 4, [6, 9]),
    "decode-many-lengths": (5, 1, 8, 2, 64, 16, [1, 17, 64, 100, 250]),
}


@isa_param
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_reference(case, dtype, isa, close):
    built(isa)
    B, L, nh, nkv, D, bs, seq_lens = CASES[case]
    q, kc, vc, bt, seq, max_len = make_inputs(B, L, nh, nkv, D, bs, seq_lens, dtype)
    ref = paged_attention_decode_ref(q, kc, vc, bt, seq, max_len, D ** -0.5)
    out = decode_ops.paged_attention_decode(q, kc, vc, bt, seq, max_len, D ** -0.5, isa=isa)
    assert out.shape == q.shape and out.dtype == dtype
    close(out, ref)


@isa_param
@pytest.mark.parametrize("threads,nkv,dtype", [(3, 1, torch.float32), (8, 1, torch.float32),
                                              (2, 3, torch.bfloat16), (2, 3, torch.float32)])
def test_split_context_matches_reference(isa, threads, nkv, dtype, close):
    """More threads than (request, kv head) tasks, or tasks that do not divide evenly over the
    threads (3 KV heads on 2: each task then takes every head over its part of the context): the
    context is split and merged."""
    built(isa)
    q, kc, vc, bt, seq, max_len = make_inputs(1, 2, 3 * nkv, nkv, 40, 16, [1300], dtype)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = decode_ops.paged_attention_decode(q, kc, vc, bt, seq, max_len, 0.2, isa=isa)
    finally:
        torch.set_num_threads(prev)
    close(out, paged_attention_decode_ref(q, kc, vc, bt, seq, max_len, 0.2))


def test_int64_block_table_and_strided_query(close):
    """q as a view with a padded head stride (last dim contiguous), int64 block table/lengths."""
    built(decode_ops.cpu_isa())
    q, kc, vc, bt, seq, max_len = make_inputs(2, 2, 4, 2, 16, 4, [7, 13], torch.float32)
    qbig = torch.randn(2, 2, 4, 32)
    qbig[..., :16] = q
    out = decode_ops.paged_attention_decode(qbig[..., :16], kc, vc, bt.long(), seq.long(), max_len, 0.25)
    close(out, paged_attention_decode_ref(q, kc, vc, bt, seq, max_len, 0.25))


def test_comparison_catches_wrong_causal_limit_and_gqa(differs):
    built(decode_ops.cpu_isa())
    B, L, nh, nkv, D = 2, 3, 4, 2, 16
    q, kc, vc, bt, seq, max_len = make_inputs(B, L, nh, nkv, D, 4, [9, 14], torch.float32)
    out = decode_ops.paged_attention_decode(q, kc, vc, bt, seq, max_len, D ** -0.5)
    # every row seeing the whole sequence (no per-row causal limit)
    no_causal = torch.cat([paged_attention_decode_ref(q[:, t:t + 1], kc, vc, bt, seq, max_len, D ** -0.5)
                           for t in range(L)], dim=1)
    differs(out, no_causal)
    # query head h reading KV head h % nkv instead of h // r
    r = nh // nkv
    pi = torch.tensor([(h % nkv) * r + h // nkv for h in range(nh)])
    qp = torch.empty_like(q)
    qp[:, :, pi] = q
    differs(out, paged_attention_decode_ref(qp, kc, vc, bt, seq, max_len, D ** -0.5)[:, :, pi])


def test_rejects_bad_arguments():
    built(decode_ops.cpu_isa())
    q, kc, vc, bt, seq, max_len = make_inputs(2, 1, 4, 2, 16, 4, [5, 9], torch.float32)
    f = decode_ops.paged_attention_decode
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        f(q[:, :, :3], kc, vc, bt, seq, max_len, 0.25)
    with pytest.raises(ValueError, match="differ in shape"):
        f(q, kc, vc[:, :2], bt, seq, max_len, 0.25)
    with pytest.raises(ValueError, match="v_cache is BFloat16"):
        f(q, kc, vc.to(torch.bfloat16), bt, seq, max_len, 0.25)
    with pytest.raises(ValueError, match="outside"):
        f(q, kc, vc, bt, torch.tensor([5, 10_000], dtype=torch.int32), max_len, 0.25)
    with pytest.raises(ValueError, match="cannot hold"):
        f(q.expand(2, 3, 4, 16), kc, vc, bt, torch.tensor([5, 2], dtype=torch.int32), max_len, 0.25)
    bad = bt.clone()
    bad[1, 0] = kc.shape[0] + 5
    with pytest.raises(ValueError, match="block_table holds"):
        f(q, kc, vc, bad, seq, max_len, 0.25)
