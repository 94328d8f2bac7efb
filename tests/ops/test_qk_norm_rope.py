"""The attention prologue kernel (q / k RMSNorm + RoPE + K/V cache write, one launch) against its
torch reference (ops.rotary.qk_norm_rope_write_kv_ref), with q a strided slice of the joined
projection as the layer passes it, partial rotary, and both norm conventions."""

from __future__ import annotations

import pytest
import torch

from backboard.ops.rotary import qk_norm_rope_write_kv_ref
from backboard.ops.triton import rope


def make(T, nh, nkv, D, rot, dtype, gated=True):
    qkv = torch.randn(T, nh * D * (2 if gated else 1) + 2 * nkv * D).to(dtype)
    qr = nh * D * (2 if gated else 1)
    q = qkv[:, :qr].view(T, nh, -1)[..., :D]                     # query half of [query | gate]
    k = qkv[:, qr:qr + nkv * D].view(T, nkv, D)
    v = qkv[:, qr + nkv * D:].view(T, nkv, D)
    qw, kw = (0.1 * torch.randn(D)).to(dtype), (0.1 * torch.randn(D)).to(dtype)
    positions = torch.randint(0, 5000, (T + 3,))[3:]                # a slice at an offset
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rot, 2).float() / rot))
    cache = torch.randn(6, 4, nkv, D).to(dtype)
    slots = torch.randperm(24)[:T]
    return q, k, v, qw, kw, positions, inv_freq, cache, slots


@pytest.mark.parametrize("T,nh,nkv,D,rot,dtype,zc", [
    (5, 4, 2, 32, 16, torch.float32, True),       # partial rotary, GQA, zero-centred norm
    (3, 2, 2, 64, 64, torch.bfloat16, False),     # full rotary, plain norm
    (4, 4, 1, 24, 8, torch.bfloat16, True),       # head_dim not a power of two
])
def test_matches_reference(T, nh, nkv, D, rot, dtype, zc, close):
    q, k, v, qw, kw, pos, inv_freq, cache, slots = make(T, nh, nkv, D, rot, dtype)
    kc1, vc1, kc2, vc2 = cache.clone(), cache.clone() + 1, cache.clone(), cache.clone() + 1
    ref = qk_norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, zc, pos, inv_freq, kc1, vc1, slots)
    got = rope.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, zc, pos, inv_freq, kc2, vc2, slots)
    assert got.is_contiguous() and got.shape == (T, nh, D)
    close(got, ref)
    close(kc2, kc1)
    close(vc2, vc1, rtol=0, atol=0)


def test_catches_wrong_positions(close, differs):
    """Off-by-one positions (a plausible bug) fail the comparison."""
    q, k, v, qw, kw, pos, inv_freq, cache, slots = make(4, 2, 1, 32, 32, torch.float32)
    ref = qk_norm_rope_write_kv_ref(q, k, v, qw, kw, 1e-6, True, pos, inv_freq, cache.clone(),
                                    cache.clone(), slots)
    got = rope.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, True, pos + 1, inv_freq, cache.clone(),
                                     cache.clone(), slots)
    differs(got, ref)


def test_bad_arguments_are_clear_errors():
    q, k, v, qw, kw, pos, inv_freq, cache, slots = make(3, 2, 1, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="rotary dims"):
        rope.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, True, pos, torch.ones(20), cache,
                                   cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, True, pos, inv_freq, cache, cache,
                                   slots[:2])
