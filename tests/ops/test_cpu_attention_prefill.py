"""The C++ causal prefill attention (ops/cpu/prefill_attention.h, AVX512-BF16 builds) against the
fp32 oracle and torch's bf16 SDPA (ops.attention.paged_attention_prefill_ref): spans with and
without earlier context, lengths off the 16-query and 32-key blocks, GQA ratios, head dims,
block sizes, shuffled block tables; on AMX CPUs both the AMX tiles (amx_bf16) and VDPBF16PS
(avx512_bf16); the dispatcher's choice on every ISA level."""

from __future__ import annotations

import pytest
import torch

from backboard.ops import dispatch
from backboard.ops.attention import attention_ref, paged_attention_prefill_ref
from backboard.ops.cpu import decode_ops
from backboard.ops.cpu.build import supported_isas
from tests.ops.cpu_isas import TEST_ISAS, built

HAS_BF16_DOT = "avx512_bf16" in supported_isas()
# the builds with the kernel this CPU runs: amx_bf16 runs its products on AMX tiles
DOT_ISAS = [lv for lv in ("amx_bf16", "avx512_bf16") if lv in supported_isas()] or ["avx512_bf16"]
dot_isa = pytest.mark.parametrize("isa", DOT_ISAS)


def make_inputs(L, S, nh, nkv, D, bs, spare=3):
    """q [L, nh, D] bf16 for the last L of S tokens, caches with the S tokens at the blocks of a
    shuffled block table (one spare entry at its end)."""
    used = -(-S // bs)
    num_blocks = used + spare
    k_cache = torch.randn(num_blocks, bs, nkv, D).bfloat16()
    v_cache = torch.randn(num_blocks, bs, nkv, D).bfloat16()
    row = torch.randperm(num_blocks)[:used + 1].to(torch.int32)
    return torch.randn(L, nh, D).bfloat16(), k_cache, v_cache, row


def dense_kv(cache, row, S):
    """The S tokens of a request as [S, nkv, D], read through its block table row."""
    bs = cache.shape[1]
    return cache[row[: -(-S // bs)].long()].reshape(-1, *cache.shape[2:])[:S]


CASES = {
    # L, S, nh, nkv, D, bs
    "tiny-mqa": (5, 5, 2, 1, 32, 4),
    "odd-lengths-r2": (37, 37, 4, 2, 64, 16),
    "context-r3": (20, 70, 6, 2, 128, 16),
    "one-query-with-context": (1, 33, 4, 4, 64, 8),
    "bench-shape": (100, 100, 4, 2, 256, 16),
    "long-context-block1": (48, 300, 2, 2, 96, 1),
    "r6-many-blocks": (130, 161, 12, 2, 128, 32),
}


@pytest.mark.skipif(not HAS_BF16_DOT, reason="the kernel needs VDPBF16PS; test_dispatch_* covers this CPU")
@pytest.mark.parametrize("case", list(CASES))
@dot_isa
def test_prefill_attention_matches_oracle_and_sdpa(case, isa, close):
    built(isa)
    L, S, nh, nkv, D, bs = CASES[case]
    q, kc, vc, row = make_inputs(L, S, nh, nkv, D, bs)
    scale = D ** -0.5
    out = decode_ops.paged_attention_prefill(q, kc, vc, row, S, scale, isa=isa)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    oracle = attention_ref(q, dense_kv(kc, row, S), dense_kv(vc, row, S), scale, ctx=S - L)
    close(out, oracle, torch.bfloat16, rtol=2e-2, atol=1.5e-2)
    close(out, paged_attention_prefill_ref(q, kc, vc, row, S, scale), torch.bfloat16, rtol=2e-2, atol=1.5e-2)


@pytest.mark.skipif(not HAS_BF16_DOT, reason="the kernel needs VDPBF16PS")
@dot_isa
def test_comparison_catches_wrong_causal_limit_and_gqa(isa, close, differs):
    built(isa)
    L, S, nh, nkv, D = 40, 56, 4, 2, 64
    q, kc, vc, row = make_inputs(L, S, nh, nkv, D, 8)
    out = decode_ops.paged_attention_prefill(q, kc, vc, row, S, 0.125, isa=isa)
    k, v = dense_kv(kc, row, S), dense_kv(vc, row, S)
    close(out, attention_ref(q, k, v, 0.125, ctx=S - L), torch.bfloat16, atol=1.5e-2)
    differs(out, attention_ref(q, k, v, 0.125, ctx=S - L + 1), torch.bfloat16, atol=1.5e-2)   # one key too many
    differs(out, attention_ref(q, k, v, 0.125, ctx=S - L - 1), torch.bfloat16, atol=1.5e-2)   # one key too few
    # query head h reading KV head h % nkv instead of h // r
    r = nh // nkv
    pi = torch.tensor([(h % nkv) * r + h // nkv for h in range(nh)])
    qp = torch.empty_like(q)
    qp[:, pi] = q
    differs(out, attention_ref(qp, k, v, 0.125, ctx=S - L)[:, pi], torch.bfloat16, atol=1.5e-2)


@pytest.mark.skipif(not HAS_BF16_DOT, reason="the kernel needs VDPBF16PS")
@pytest.mark.parametrize("threads", [1, 3])
@dot_isa
def test_strided_query_int64_table_and_thread_counts(threads, isa, close):
    """q as the q part of a joined projection (head stride past D), an int64 block table, and
    task counts that do not divide evenly over the threads."""
    built(isa)
    L, S, nh, nkv, D = 70, 90, 4, 2, 64
    q, kc, vc, row = make_inputs(L, S, nh, nkv, D, 16)
    joined = torch.randn(L, nh, 2 * D).bfloat16()
    joined[..., :D] = q
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = decode_ops.paged_attention_prefill(joined[..., :D], kc, vc, row.long(), S, 0.1, isa=isa)
    finally:
        torch.set_num_threads(prev)
    close(out, attention_ref(q, dense_kv(kc, row, S), dense_kv(vc, row, S), 0.1, ctx=S - L), torch.bfloat16,
          atol=1.5e-2)


@pytest.mark.skipif(not HAS_BF16_DOT, reason="the kernel needs VDPBF16PS")
def test_rejects_bad_arguments():
    built("avx512_bf16")
    q, kc, vc, row = make_inputs(8, 20, 4, 2, 64, 4)

    def f(*a):
        return decode_ops.paged_attention_prefill(*a, isa="avx512_bf16")

    with pytest.raises(ValueError, match="must be bfloat16"):
        f(q.float(), kc.float(), vc.float(), row, 20, 0.1)
    with pytest.raises(ValueError, match="multiple of 32"):
        f(q[..., :48], kc[..., :48], vc[..., :48], row, 20, 0.1)
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        f(q[:, :3], kc, vc, row, 20, 0.1)
    with pytest.raises(ValueError, match="at least L"):
        f(q, kc, vc, row, 7, 0.1)
    with pytest.raises(ValueError, match="needs 5 entries"):
        f(q, kc, vc, row[:4], 20, 0.1)
    bad = row.clone()
    bad[2] = kc.shape[0] + 1
    with pytest.raises(ValueError, match="outside"):
        f(q, kc, vc, bad, 20, 0.1)


@pytest.mark.parametrize("isa", TEST_ISAS)
def test_only_bf16_dot_builds_have_the_kernel(isa):
    assert built(isa).has_prefill_attention() == (isa in ("amx_bf16", "avx512_bf16"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dispatch_runs_the_kernel_where_built_else_sdpa(dtype, close, monkeypatch):
    """The dispatcher's result equals the kernel's on an AVX512-BF16 CPU for bf16 caches, and
    torch's SDPA (bit for bit) everywhere else: other ISA levels, fp32, head dims off 32."""
    q, kc, vc, row = make_inputs(24, 40, 4, 2, 64, 8)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    ref = paged_attention_prefill_ref(q, kc, vc, row, 40, 0.1)
    got = dispatch.paged_attention_prefill(q, kc, vc, row, 40, 0.1)
    if HAS_BF16_DOT and dtype == torch.bfloat16 and decode_ops.has_prefill_attention():
        assert torch.equal(got, decode_ops.paged_attention_prefill(q, kc, vc, row, 40, 0.1))
        close(got, ref, torch.bfloat16, atol=1.5e-2)
    else:
        assert torch.equal(got, ref)
    odd = dispatch.paged_attention_prefill(q[..., :48], kc[..., :48], vc[..., :48], row, 40, 0.1)
    assert torch.equal(odd, paged_attention_prefill_ref(q[..., :48], kc[..., :48], vc[..., :48], row, 40, 0.1))
