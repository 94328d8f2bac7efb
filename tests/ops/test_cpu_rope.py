"""The C++ attention prologue (ops/cpu/rope.h: q / k RMSNorm + RoPE + K/V cache write) against
its torch reference, on every ISA level the machine runs: q a strided slice of the joined
projection, partial and full rotary, both norm conventions, positions up to 5000."""

from __future__ import annotations

import pytest
import torch

from backboard.ops import dispatch
from backboard.ops.cpu import decode_ops
from backboard.ops.rotary import qk_norm_rope_write_kv_ref
from tests.ops.cpu_isas import built, isa_param
from tests.ops.test_qk_norm_rope import make

# rounded where the reference rounds; cos / sin come from libm rather than torch's vectorised
# ones (an ulp apart now and then in fp32, which can move a bf16 rounding by one ulp)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def run_both(args, zc, isa):
    q, k, v, qw, kw, pos, inv_freq, cache, slots = args
    kc1, vc1, kc2, vc2 = cache.clone(), cache.clone() + 1, cache.clone(), cache.clone() + 1
    ref = qk_norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, zc, pos, inv_freq, kc1, vc1, slots)
    got = decode_ops.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, zc, pos, inv_freq, kc2, vc2, slots, isa=isa)
    return (ref, kc1, vc1), (got, kc2, vc2)


@isa_param
@pytest.mark.parametrize("T,nh,nkv,D,rot,dtype,zc", [
    (5, 4, 2, 32, 16, torch.float32, True),       # partial rotary, GQA, zero-centred norm
    (3, 2, 2, 64, 64, torch.bfloat16, False),     # full rotary, plain norm
    (4, 4, 1, 24, 8, torch.bfloat16, True),       # head_dim off the vector width
    (20, 4, 2, 256, 64, torch.bfloat16, True),    # the Qwen3.5 head: 256 dims, a quarter rotated
])
def test_matches_reference(T, nh, nkv, D, rot, dtype, zc, isa, close):
    built(isa)
    (ref, kc1, vc1), (got, kc2, vc2) = run_both(make(T, nh, nkv, D, rot, dtype), zc, isa)
    assert got.is_contiguous() and got.shape == (T, nh, D) and got.dtype == dtype
    close(got, ref, **TOL[dtype])
    close(kc2, kc1, **TOL[dtype])
    assert torch.equal(vc2, vc1)                                  # v is copied, never rounded


def test_wrong_positions_or_slots_fail_the_comparison(close, differs):
    args = make(4, 2, 1, 32, 32, torch.float32)
    q, k, v, qw, kw, pos, inv_freq, cache, slots = args
    ref = qk_norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, True, pos, inv_freq, cache.clone(), cache.clone(), slots)
    differs(decode_ops.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, True, pos + 1, inv_freq, cache.clone(),
                                             cache.clone(), slots), ref)
    kc1, kc2 = cache.clone(), cache.clone()
    qk_norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, True, pos, inv_freq, kc1, cache.clone(), slots)
    decode_ops.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, True, pos, inv_freq, kc2, cache.clone(), slots.flip(0))
    differs(kc2, kc1)


def test_bad_arguments_are_clear_errors():
    q, k, v, qw, kw, pos, inv_freq, cache, slots = make(3, 2, 1, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="rotary dims"):
        decode_ops.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, True, pos, torch.ones(20), cache, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        decode_ops.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, True, pos, inv_freq, cache, cache, slots[:2])
    with pytest.raises(ValueError, match="slot_mapping holds"):
        decode_ops.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, True, pos, inv_freq, cache, cache, slots + 100)


def test_dispatch_runs_it_on_cpu_tensors(monkeypatch):
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    used = []
    real = decode_ops.qk_norm_rope_write_kv
    monkeypatch.setattr(decode_ops, "qk_norm_rope_write_kv", lambda *a, **kw: used.append(1) or real(*a, **kw))
    q, k, v, qw, kw, pos, inv_freq, cache, slots = make(2, 2, 1, 32, 16, torch.bfloat16)
    dispatch.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, True, pos, inv_freq, cache, cache.clone(), slots)
    assert used


@isa_param
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_without_norm_is_rope_and_cache_write(dtype, isa, close):
    """Llama / Qwen2 (no q / k norm): the kernel with no weights equals RoPE applied by the torch
    composition the layer used before (cos_sin, apply_rotary, write_kv), bit for bit in the
    reference, and the C++ result to the rounding of its libm cos / sin."""
    from backboard.ops.attention import write_kv
    from backboard.ops.rotary import apply_rotary_ref, rotary_cos_sin_ref

    built(isa)
    q, k, v, _, _, pos, inv_freq, cache, slots = make(6, 6, 2, 64, 64, dtype, gated=False)
    cos, sin = rotary_cos_sin_ref(pos, inv_freq, dtype)
    kc0, vc0 = cache.clone(), cache.clone() + 1
    write_kv(apply_rotary_ref(k, cos, sin), v, kc0, vc0, slots)
    old_q = apply_rotary_ref(q, cos, sin)
    (ref, kc1, vc1), (got, kc2, vc2) = run_both((q, k, v, None, None, pos, inv_freq, cache, slots), False, isa)
    assert torch.equal(ref, old_q) and torch.equal(kc1, kc0) and torch.equal(vc1, vc0)
    close(got, ref, **TOL[dtype])
    close(kc2, kc1, **TOL[dtype])
    assert torch.equal(vc2, vc1)
    with_norm = qk_norm_rope_write_kv_ref(q, k, v, torch.ones(64, dtype=dtype), torch.ones(64, dtype=dtype), 1e-6,
                                          False, pos, inv_freq, cache.clone(), cache.clone(), slots)
    assert not torch.allclose(with_norm.float(), got.float(), atol=1e-2)     # the norm is really skipped
    with pytest.raises(ValueError, match="both be given or both be None"):
        decode_ops.qk_norm_rope_write_kv(q, k, v, None, torch.ones(64, dtype=dtype), 1e-6, False, pos, inv_freq,
                                         cache.clone(), cache.clone(), slots, isa=isa)
