"""GDN state snapshots inside prefill spans (layers/state_snapshots.py), on every prefill backend
this machine runs (the torch reference, the C++ kernel where it is built, Triton in its
interpreter): the output and the spans' final states equal one call over the whole spans, and
each snapshot slot holds exactly the state that prefilling the span's first `offset` tokens alone
leaves (conv window and recurrent state)."""

from __future__ import annotations

import pytest
import torch

from backboard.forward_context import StateSnapshot
from backboard.layers.state_snapshots import prefill_with_snapshots
from backboard.ops import dispatch
from backboard.ops.gdn.prefill import gdn_prefill_ref

NK, NV, DK, DV, K = 2, 4, 16, 16, 4
C = 2 * NK * DK + NV * DV
HEADS = dict(num_k_heads=NK, num_v_heads=NV, head_k_dim=DK, head_v_dim=DV, eps=1e-6)
LENS = [40, 9, 70]
SLOTS = torch.tensor([3, 7, 1])
INIT = torch.tensor([True, False, True])
SNAPS = [StateSnapshot(0, 1, 9), StateSnapshot(0, 17, 4), StateSnapshot(2, 69, 10)]   # span 1: none
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _backends():
    out = [("reference", gdn_prefill_ref)]
    if dispatch.use_cpu_decode_ops(torch.zeros(1, dtype=torch.bfloat16)):
        out.append(("cpu-kernel", dispatch._gdn_prefill_recurrent))
    return out


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    P = sum(LENS)
    model = dict(conv_weight=(torch.randn(C, K, generator=g) * 0.5).to(dtype),
                 A_log=torch.empty(NV).uniform_(1, 16, generator=g).log(),
                 dt_bias=torch.randn(NV, generator=g).to(dtype),
                 norm_weight=(1 + 0.1 * torch.randn(DV, generator=g)).to(dtype))
    proj = torch.randn(P, C + NV * DV + 2 * NV, generator=g).to(dtype)
    conv = torch.randn(12, K - 1, C, generator=g).to(dtype)
    ssm = torch.randn(12, NV, DK, DV, generator=g) * 0.1
    return proj, model, conv, ssm


def _runner(fn, model, conv, ssm):
    def run(rows, cu, slots, init):
        return fn(rows, model["conv_weight"], conv, model["A_log"], model["dt_bias"],
                  model["norm_weight"], ssm, cu, slots, init, **HEADS)
    return run


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _check(fn, dtype, close):
    proj, model, conv, ssm = _inputs(dtype)
    cu = _cu(LENS)
    whole_conv, whole_ssm = conv.clone(), ssm.clone()
    whole = _runner(fn, model, whole_conv, whole_ssm)(proj, cu, SLOTS, INIT)
    snap_conv, snap_ssm = conv.clone(), ssm.clone()
    out = prefill_with_snapshots(_runner(fn, model, snap_conv, snap_ssm), proj, cu, SLOTS, INIT,
                                 SNAPS, (snap_conv, snap_ssm))
    close(out, whole, dtype, **TOL[dtype])
    close(snap_conv[SLOTS], whole_conv[SLOTS], dtype, rtol=0, atol=0)
    close(snap_ssm[SLOTS], whole_ssm[SLOTS], torch.float32, **TOL[dtype])
    for s in SNAPS:                 # the span's first `offset` tokens alone, from the same state
        c1, s1 = conv.clone(), ssm.clone()
        start = cu[s.span]
        _runner(fn, model, c1, s1)(proj[start:start + s.offset], [0, s.offset], SLOTS[s.span:s.span + 1],
                                   INIT[s.span:s.span + 1])
        close(snap_conv[s.slot], c1[SLOTS[s.span]], dtype, rtol=0, atol=0)
        close(snap_ssm[s.slot], s1[SLOTS[s.span]], torch.float32, **TOL[dtype])
    return snap_ssm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,fn", _backends())
def test_snapshots_inside_spans_match_prefilling_the_prefix_alone(name, fn, dtype, close):
    _check(fn, dtype, close)


def test_snapshots_on_the_triton_kernels_in_the_interpreter(close):
    from backboard.ops.triton import gdn_prefill as gp

    _check(gp.gdn_prefill, torch.float32, close)


def test_a_snapshot_outside_its_span_is_refused():
    proj, model, conv, ssm = _inputs(torch.float32)
    run = _runner(gdn_prefill_ref, model, conv, ssm)
    for bad in ([StateSnapshot(1, 9, 4)], [StateSnapshot(0, 17, 4), StateSnapshot(0, 1, 9)]):
        with pytest.raises(ValueError, match="inside the span"):
            prefill_with_snapshots(run, proj, _cu(LENS), SLOTS, INIT, bad, (conv, ssm))


def test_the_check_catches_a_snapshot_taken_at_the_wrong_place(close, differs):
    """A snapshot one token late holds a different state than the prefix alone leaves."""
    proj, model, conv, ssm = _inputs(torch.float32)
    cu = _cu(LENS)
    c1, s1 = conv.clone(), ssm.clone()
    prefill_with_snapshots(_runner(gdn_prefill_ref, model, c1, s1), proj, cu, SLOTS, INIT,
                           [StateSnapshot(0, 18, 9)], (c1, s1))
    c2, s2 = conv.clone(), ssm.clone()
    _runner(gdn_prefill_ref, model, c2, s2)(proj[:17], [0, 17], SLOTS[:1], INIT[:1])
    differs(s1[9], s2[SLOTS[0]], torch.float32, **TOL[torch.float32])
