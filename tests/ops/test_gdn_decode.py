"""The fused GDN decode / verify step (two Triton kernels) against the composition of the torch
ops (ops.gdn.decode.gdn_decode_ref): output, conv states and recurrent states of every slot."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backboard.ops.conv1d import causal_conv1d_update
from backboard.ops.gdn.decode import gdn_decode_ref
from backboard.ops.gdn.recurrent import gdn_recurrent
from backboard.ops.norm import gated_rms_norm_ref
from backboard.ops.triton import gdn_decode as gk

NUM_SLOTS = 16
# bf16: one-ulp rounding differences in the conv output (the interpreter truncates) move the
# l2-normalised q / k and propagate through the recurrence; the mutant tests below show that
# this tolerance still catches real mistakes
GDN_TOL = {torch.float32: {}, torch.bfloat16: dict(rtol=3e-2, atol=6e-2)}


def make_inputs(B, L, nk, nv, dk, dv, K, dtype, per_position, alias=True, init="mixed"):
    C = 2 * nk * dk + nv * dv
    P = C + nv * dv + 2 * nv
    proj = torch.randn(B * L, P).to(dtype)
    weight = (torch.randn(C, K) * 0.5).to(dtype)
    conv = torch.randn(NUM_SLOTS, K - 1, C).to(dtype)
    ssm = torch.randn(NUM_SLOTS, nv, dk, dv) * 0.1
    A_log = torch.empty(nv).uniform_(1, 16).log()
    dt_bias = torch.randn(nv).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(dv)).to(dtype)
    src = torch.tensor([3, 7, 1])[:B]
    if per_position:
        dst = torch.arange(B * L).view(B, L) + 8            # slots 8.. (disjoint from src)
        if alias:
            dst[:, 0] = src                                 # row 0 overwrites the source slot
    else:
        dst = src if alias else torch.tensor([12, 5, 9])[:B]
    has_init = {"mixed": torch.tensor([True, False, True])[:B], "none": None,
                "all": torch.ones(B, dtype=torch.bool)}[init]
    kw = dict(num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv, eps=1e-6)
    return (proj, weight, conv, A_log, dt_bias, norm_w, ssm, src, dst, has_init), kw


def run_both(args, kw, fn=gk.gdn_decode):
    proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init = args
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    ref = gdn_decode_ref(proj, w, c1, A_log, dt_bias, nw, s1, src, dst, init, **kw)
    out = fn(proj, w, c2, A_log, dt_bias, nw, s2, src, dst, init, **kw)
    return (out, c2, s2), (ref, c1, s1)


CASES = [
    # B, L, nk, nv, dk, dv, K, per_position, alias, init
    (3, 1, 2, 4, 16, 32, 4, False, True, "mixed"),     # decode, GQA r=2, dk != dv, dst == src
    (2, 1, 2, 2, 32, 16, 4, False, False, "none"),     # decode, r=1, dk > dv, dst != src
    (2, 3, 2, 4, 32, 16, 4, True, True, "mixed"),      # verify, per-position slots, dst[:, 0] == src
    (2, 5, 1, 3, 16, 16, 3, False, False, "all"),      # 5 rows, final state only, K=3, r=3
]


FP32, BF16 = torch.float32, torch.bfloat16
MATRIX = ([(case, dt, None) for case in range(len(CASES)) for dt in (FP32, BF16)]   # default split
          + [(0, BF16, 64), (2, FP32, 64),           # one program per head, norm fused in-kernel
             (0, FP32, 16), (3, BF16, 16)])          # two / one column blocks per head


@pytest.mark.parametrize("case,dtype,block_v", MATRIX, ids=[
    f"{['decode-gqa', 'decode-r1', 'verify', 'multi-row-final'][c]}-{str(d)[6:]}-bv{b}" for c, d, b in MATRIX])
def test_gdn_decode_matches_reference(case, dtype, block_v, close):
    B, L, nk, nv, dk, dv, K, per, alias, init = CASES[case]
    args, kw = make_inputs(B, L, nk, nv, dk, dv, K, dtype, per, alias, init)

    def kernel(*a, **k):
        return gk.gdn_decode(*a, **k, block_v=block_v)
    (out, conv, ssm), (ref, conv_ref, ssm_ref) = run_both(args, kw, fn=kernel)
    assert out.shape == (B * L, nv * dv) and out.dtype == dtype
    close(out, ref, dtype, **GDN_TOL[dtype])
    close(conv, conv_ref, dtype, rtol=0, atol=0)   # every slot, written or not: exact copies
    close(ssm, ssm_ref, dtype, **GDN_TOL[dtype])
    # the states really moved (the comparison is not of two untouched copies)
    assert not torch.equal(ssm_ref, args[6])


def test_verify_writes_every_position(close):
    """dst_slots [B, L]: slot dst[b, t] holds the state after row t, which is the final state of
    the same step run over the first t + 1 rows only."""
    args, kw = make_inputs(2, 3, 2, 4, 16, 16, 4, torch.float32, per_position=True, alias=False)
    proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init = args
    c, s = conv.clone(), ssm.clone()
    gk.gdn_decode(proj, w, c, A_log, dt_bias, nw, s, src, dst, init, **kw)
    rows = proj.view(2, 3, -1)
    for t in range(3):
        c2, s2 = conv.clone(), ssm.clone()
        part = rows[:, :t + 1].reshape(-1, proj.shape[1])
        gdn_decode_ref(part, w, c2, A_log, dt_bias, nw, s2, src, dst[:, t].contiguous(), init, **kw)
        close(s[dst[:, t]], s2[dst[:, t]])
        close(c[dst[:, t]], c2[dst[:, t]])


def _wrong_gqa_ref(proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init, *, num_k_heads,
                   num_v_heads, head_k_dim, head_v_dim, eps):
    """A plausible bug: value head j reads key head j % nk (tiled) instead of j // r."""
    nk, nv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    T, B = proj.shape[0], src.shape[0]
    L, C = T // B, 2 * nk * dk + nv * dv
    qkv, z, b, a = torch.split(proj, [C, nv * dv, nv, nv], dim=-1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    mixed = causal_conv1d_update(qkv.reshape(B, L, C), w, conv, src, dst, init)
    q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
    q = q.reshape(B, L, nk, dk).repeat(1, 1, nv // nk, 1)
    k = k.reshape(B, L, nk, dk).repeat(1, 1, nv // nk, 1)
    core = gdn_recurrent(q, k, v.reshape(B, L, nv, dv), g.view(B, L, nv),
                         b.float().sigmoid().view(B, L, nv), ssm, src, dst, init)
    return gated_rms_norm_ref(core.to(proj.dtype).reshape(T, nv, dv), z.reshape(T, nv, dv), nw, eps,
                          proj.dtype).reshape(T, nv * dv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_comparison_catches_wrong_gqa_mapping(dtype, differs):
    args, kw = make_inputs(2, 1, 2, 4, 16, 32, 4, dtype, per_position=False)
    (out, _, ssm), (wrong, _, ssm_wrong) = run_both(args, kw, fn=_wrong_gqa_ref)
    differs(out, wrong, dtype, **GDN_TOL[dtype])
    differs(ssm, ssm_wrong, dtype, **GDN_TOL[dtype])


def test_comparison_catches_final_only_verify(differs):
    """Writing only the final state (dst [B]) instead of every position must be caught."""
    args, kw = make_inputs(2, 3, 2, 4, 16, 16, 4, torch.float32, per_position=True, alias=False)
    proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init = args
    s1, s2 = ssm.clone(), ssm.clone()
    gk.gdn_decode(proj, w, conv.clone(), A_log, dt_bias, nw, s1, src, dst, init, **kw)
    gdn_decode_ref(proj, w, conv.clone(), A_log, dt_bias, nw, s2, src, dst[:, -1].contiguous(), init, **kw)
    differs(s1, s2)


def test_launchers_reject_bad_arguments():
    args, kw = make_inputs(2, 1, 2, 4, 16, 32, 4, torch.float32, per_position=False)
    proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init = args

    def call(**over):
        a = dict(proj=proj, conv_weight=w, conv_state=conv, A_log=A_log, dt_bias=dt_bias,
                 norm_weight=nw, ssm_state=ssm, src_slots=src, dst_slots=dst, has_initial_state=init)
        a.update(over)
        return gk.gdn_decode(**a, **kw)

    with pytest.raises(ValueError, match="ssm_state"):
        call(ssm_state=ssm.to(torch.bfloat16))                      # states must be fp32
    with pytest.raises(ValueError, match="multiple of B"):
        call(proj=proj[:1], src_slots=torch.tensor([0, 1, 2]), dst_slots=torch.tensor([0, 1, 2]),
             has_initial_state=None)
    with pytest.raises(ValueError, match="dst_slots"):
        call(dst_slots=torch.zeros(2, 2, dtype=torch.int64))        # [B, L] with the wrong L
    with pytest.raises(ValueError, match="conv_state"):
        call(conv_state=conv[:, :2])                                # K-1 columns expected
    with pytest.raises(ValueError, match="contiguous"):
        call(proj=torch.randn(proj.shape[1], 2).t())                # last dim not contiguous
    with pytest.raises(ValueError, match="has_initial_state"):
        call(has_initial_state=torch.ones(2))                       # bool expected
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        gk.gdn_decode(proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init,
                      **{**kw, "num_k_heads": 3})
