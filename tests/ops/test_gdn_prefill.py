"""The Triton GDN prefill path (conv, chunk transform, chunk scan, gated norm) against its torch
reference (ops.gdn.prefill.gdn_prefill_ref: conv1d varlen -> chunked delta rule -> gated norm):
outputs, and the conv and recurrent states of every slot, for several spans in one flat batch at
lengths around the chunk size, with and without initial states."""

from __future__ import annotations

import pytest
import torch

from backboard.ops.gdn.prefill import gdn_prefill_ref
from backboard.ops.triton import gdn_prefill as gp

NUM_SLOTS = 12
# bf16: the interpreter truncates where torch rounds (conv output, core), and one-ulp differences
# in the conv output move the l2-normalised q / k through 70 steps of recurrence; fp32 is tight
TOL = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.bfloat16: dict(rtol=5e-2, atol=0.15)}


def make_inputs(lens, nk, nv, dk, dv, K, dtype, init):
    C = 2 * nk * dk + nv * dv
    P = sum(lens)
    proj = torch.randn(P, C + nv * dv + 2 * nv).to(dtype)
    weight = (torch.randn(C, K) * 0.5).to(dtype)
    conv = torch.randn(NUM_SLOTS, K - 1, C).to(dtype)
    ssm = torch.randn(NUM_SLOTS, nv, dk, dv) * 0.1
    A_log = torch.empty(nv).uniform_(1, 16).log()
    dt_bias = torch.randn(nv).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(dv)).to(dtype)
    # slices at an offset of the step's arrays, as the layer passes them
    slots = torch.tensor([4, 9, 2, 7, 0, 11, 5])[1:1 + len(lens)]
    flags = torch.tensor([True, *init])[1:]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    kw = dict(num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv, eps=1e-6)
    return (proj, weight, conv, A_log, dt_bias, norm_w, ssm, cu, slots, flags), kw


def run_both(args, kw):
    proj, w, conv, A_log, dt_bias, nw, ssm, cu, slots, flags = args
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    ref = gdn_prefill_ref(proj, w, c1, A_log, dt_bias, nw, s1, cu, slots, flags, **kw)
    out = gp.gdn_prefill(proj, w, c2, A_log, dt_bias, nw, s2, cu, slots, flags, **kw)
    return (out, c2, s2), (ref, c1, s1)


CASES = [
    # lens, nk, nv, dk, dv, K, dtype, init
    ([1, 63, 64, 65, 130], 2, 4, 16, 24, 4, torch.float32, [True, False, True, True, False]),
    ([2, 3, 129], 1, 3, 32, 16, 4, torch.float32, [True, True, False]),   # spans < K-1 keep old window
    ([70, 5], 2, 4, 16, 32, 4, torch.bfloat16, [True, False]),
    ([200], 2, 2, 16, 16, 3, torch.float32, [True]),                    # one span, 4 chunks, K=3
]


@pytest.mark.parametrize("lens,nk,nv,dk,dv,K,dtype,init", CASES)
def test_gdn_prefill_matches_reference(lens, nk, nv, dk, dv, K, dtype, init, close):
    args, kw = make_inputs(lens, nk, nv, dk, dv, K, dtype, init)
    (out, conv, ssm), (ref, conv_ref, ssm_ref) = run_both(args, kw)
    close(out, ref, dtype, **TOL[dtype])
    close(conv, conv_ref, dtype, rtol=0, atol=0)                 # copies, exact
    close(ssm, ssm_ref, torch.float32, **TOL[dtype])


def test_initial_state_and_span_boundaries_matter(close, differs):
    """The comparison catches a kernel that ignored initial states or leaked state across spans:
    the same tokens as one span give a different result from two."""
    lens, init = [64, 65], [True, True]
    args, kw = make_inputs(lens, 2, 4, 16, 24, 4, torch.float32, init)
    (out, _, _), (ref, _, _) = run_both(args, kw)
    close(out, ref, torch.float32, **TOL[torch.float32])
    proj, w, conv, A_log, dt_bias, nw, ssm, cu, slots, flags = args
    no_init = gp.gdn_prefill(proj, w, conv.clone(), A_log, dt_bias, nw, ssm.clone(), cu, slots,
                             torch.zeros_like(flags), **kw)
    differs(no_init, ref, torch.float32, **TOL[torch.float32])
    merged = gp.gdn_prefill(proj, w, conv.clone(), A_log, dt_bias, nw, ssm.clone(), [0, 129],
                            slots[:1], flags[:1], **kw)
    differs(merged[64:], ref[64:], torch.float32, **TOL[torch.float32])


def test_chunk_table_never_crosses_a_span():
    C = gp.CHUNK
    cu = [0, 1, 1 + C, 2 + 3 * C]
    table, n = gp._chunk_table(cu)
    assert list(table[:4]) == cu
    chunks = table[4:].reshape(n, 2).tolist()
    assert chunks == [[0, 1], [1, 1 + C], [1 + C, 1 + 2 * C], [1 + 2 * C, 1 + 3 * C],
                      [1 + 3 * C, 2 + 3 * C]]


def test_bad_spans_are_clear_errors():
    args, kw = make_inputs([3, 4], 1, 2, 16, 16, 4, torch.float32, [True, True])
    proj, w, conv, A_log, dt_bias, nw, ssm, cu, slots, flags = args
    with pytest.raises(ValueError, match="cu_seqlens"):
        gp.gdn_prefill(proj, w, conv, A_log, dt_bias, nw, ssm, [0, 3, 6], slots, flags, **kw)
    with pytest.raises(ValueError, match="slots"):
        gp.gdn_prefill(proj, w, conv, A_log, dt_bias, nw, ssm, cu, slots[:1], flags, **kw)


@pytest.mark.parametrize("lens,nk,nv,dk,dv,K,dtype,init", CASES)
def test_cpu_recurrent_prefill_matches_reference(lens, nk, nv, dk, dv, K, dtype, init, close, monkeypatch):
    """On the CPU, dispatch runs each span through the C++ decode kernel as one request of L rows
    (ops/dispatch.py: _gdn_prefill_recurrent): outputs, conv windows and states as the chunked
    reference, spans shorter than the conv window and fresh slots included."""
    from backboard.ops import dispatch
    from backboard.ops.cpu import decode_ops

    assert decode_ops.available(), "the C++ decode ops did not build"
    args, kw = make_inputs(lens, nk, nv, dk, dv, K, dtype, init)
    proj, w, conv, A_log, dt_bias, nw, ssm, cu, slots, flags = args
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    ref = gdn_prefill_ref(proj, w, c1, A_log, dt_bias, nw, s1, cu, slots, flags, **kw)
    monkeypatch.setattr(dispatch, "gdn_prefill_ref", None)      # the kernel path, not the reference
    out = dispatch.gdn_prefill(proj, w, c2, A_log, dt_bias, nw, s2, cu, slots, flags, **kw)
    close(out, ref, dtype, **TOL[dtype])
    close(c2, c1, dtype, rtol=0, atol=0)
    close(s2, s1, torch.float32, **TOL[dtype])
