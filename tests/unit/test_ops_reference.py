"""The torch forms of the ops agree with their per-token references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backboard.ops.attention import attention_ref, paged_attention_decode_ref, paged_attention_prefill_ref, write_kv
from backboard.ops.conv1d import causal_conv1d_update, causal_conv1d_varlen
from backboard.ops.gdn import gdn_chunked_varlen, gdn_recurrent, gdn_ref


def _gdn_inputs(T, nk=2, nv=4, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, nk, dk, generator=g)
    k = torch.randn(T, nk, dk, generator=g)
    v = torch.randn(T, nv, dv, generator=g)
    gate = -F.softplus(torch.randn(T, nv, generator=g))
    beta = torch.rand(T, nv, generator=g)
    return q, k, v, gate, beta


@pytest.mark.parametrize("lens", [[1], [63, 64, 65], [130, 7]])
def test_chunked_matches_reference(lens):
    T = sum(lens)
    q, k, v, g, beta = _gdn_inputs(T)
    state = torch.randn(5, 4, 16, 24) * 0.1
    init = [i % 2 == 0 for i in range(len(lens))]
    slots = [4, 1, 2][:len(lens)]
    before = state.clone()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    o = gdn_chunked_varlen(q, k, v, g, beta, state, cu, slots, init)
    for i in range(len(lens)):
        s, e = cu[i], cu[i + 1]
        ro, rs = gdn_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                               before[slots[i]] if init[i] else None)
        assert torch.allclose(o[s:e], ro, atol=1e-4, rtol=1e-4)
        assert torch.allclose(state[slots[i]], rs, atol=1e-4, rtol=1e-4)
    assert torch.equal(state[0], before[0]) and torch.equal(state[3], before[3])  # untouched


def test_recurrent_per_position_states_equal_running_the_prefix():
    """Verification form: the state written after row j equals the state of running rows 0..j."""
    B, L = 3, 4
    q, k, v, g, beta = _gdn_inputs(B * L, seed=1)
    view = lambda x: x.view(B, L, *x.shape[1:])  # noqa: E731
    state = torch.randn(16, 4, 16, 24) * 0.1
    before = state.clone()
    src = torch.tensor([0, 5, 9])
    dst = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8], [9, 10, 11, 12]])
    o = gdn_recurrent(view(q), view(k), view(v), view(g), view(beta), state, src, dst)
    for b in range(B):
        sl = slice(b * L, (b + 1) * L)
        ro, _ = gdn_ref(q[sl], k[sl], v[sl], g[sl], beta[sl], before[src[b]])
        assert torch.allclose(o[b], ro, atol=1e-5)
        for j in range(L):
            sj = slice(b * L, b * L + j + 1)
            _, rs = gdn_ref(q[sj], k[sj], v[sj], g[sj], beta[sj], before[src[b]])
            assert torch.allclose(state[dst[b, j]], rs, atol=1e-5)


def test_conv_update_matches_varlen_and_windows():
    C, K = 12, 4
    g = torch.Generator().manual_seed(2)
    w = torch.randn(C, K, generator=g)
    x = torch.randn(10, C, generator=g)
    st_a = torch.randn(4, K - 1, C, generator=g)
    st_b = st_a.clone()
    y_var = causal_conv1d_varlen(x, w, st_a, [0, 10], [2], [True])
    # one token at a time through the update path
    ys = []
    for t in range(10):
        ys.append(causal_conv1d_update(x[t:t + 1][None], w, st_b, torch.tensor([2]), torch.tensor([2]))[0])
    assert torch.allclose(torch.cat(ys), y_var, atol=1e-6)
    assert torch.allclose(st_a[2], st_b[2])
    assert torch.allclose(st_a[2], x[-(K - 1):])
    # verify form: windows after each position in their own slots
    st_c = torch.zeros(8, K - 1, C)
    st_c[0] = x[:3]
    causal_conv1d_update(x[3:6][None], w, st_c, torch.tensor([0]), torch.tensor([[5, 6, 7]]))
    for j in range(3):
        assert torch.equal(st_c[5 + j], x[j + 1:j + 4])


def test_paged_attention_matches_dense():
    g = torch.Generator().manual_seed(3)
    nh, nkv, D, bs = 4, 2, 8, 4
    k_cache = torch.zeros(16, bs, nkv, D)
    v_cache = torch.zeros(16, bs, nkv, D)
    S = 11
    k = torch.randn(S, nkv, D, generator=g)
    v = torch.randn(S, nkv, D, generator=g)
    blocks = torch.tensor([7, 2, 9], dtype=torch.int32)
    slots = torch.tensor([int(blocks[p // bs]) * bs + p % bs for p in range(S)])
    write_kv(k, v, k_cache, v_cache, slots)
    q = torch.randn(S, nh, D, generator=g)
    want = attention_ref(q, k, v, D ** -0.5)
    got = paged_attention_prefill_ref(q[5:], k_cache, v_cache, blocks, S, D ** -0.5)
    assert torch.allclose(got, want[5:], atol=1e-5)
    got_u = paged_attention_decode_ref(q[8:][None], k_cache, v_cache, blocks[None], torch.tensor([S]), S, D ** -0.5)
    assert torch.allclose(got_u[0], want[8:], atol=1e-5)
