"""The C++ RMSNorm (Norm0 and plain), fused residual add + RMSNorm, GDN gated norm and SiLU-mul
(ops/cpu/norm_act.h) against their torch references, at row widths off the vector width and on
strided views (the layers pass q / k heads and z as views of joined projections)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backboard.ops import dispatch
from backboard.ops import norm as ref
from backboard.ops.activation import silu_mul_ref
from backboard.ops.cpu import decode_ops
from tests.ops.cpu_isas import built, isa_param

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# one rounding at the end of fp32 math: bf16 results agree to the last bit but for rare ties
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=8e-3, atol=1e-2)}


def head_view(T, nh, N, dtype, pad=5):
    """[T, nh, N] as heads of a wider joined row (row stride nh*N + pad): a strided view."""
    big = torch.randn(T, nh * N + pad).to(dtype)
    return big[:, pad:].view(T, nh, N)


@isa_param
@DTYPES
@pytest.mark.parametrize("zero_centered", [True, False], ids=["norm0", "plain"])
@pytest.mark.parametrize("shape", [(5, 37), (1, 512), (3, 2, 100)], ids=str)
def test_rms_norm(shape, zero_centered, dtype, isa, close):
    built(isa)
    x = torch.randn(shape).to(dtype)
    w = (0.3 * torch.randn(shape[-1])).to(dtype)
    out = decode_ops.rms_norm(x, w, 1e-6, zero_centered, isa=isa)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, ref.rms_norm_ref(x, w, 1e-6, zero_centered), **TOL[dtype])


@isa_param
@DTYPES
def test_rms_norm_on_head_views(dtype, isa, close):
    """q_norm on the query half of a gated q projection: [T, nh, D] with a padded row stride."""
    built(isa)
    x = head_view(4, 3, 24, dtype)
    w = (0.3 * torch.randn(24)).to(dtype)
    close(decode_ops.rms_norm(x, w, 1e-6, True, isa=isa), ref.rms_norm_ref(x, w, 1e-6, True), **TOL[dtype])


@isa_param
@DTYPES
@pytest.mark.parametrize("zero_centered", [True, False], ids=["norm0", "plain"])
def test_fused_add_rms_norm(zero_centered, dtype, isa, close):
    built(isa)
    x, res = torch.randn(7, 100).to(dtype), torch.randn(7, 100).to(dtype)
    w = (0.3 * torch.randn(100)).to(dtype)
    out, r = decode_ops.fused_add_rms_norm(x, res, w, 1e-6, zero_centered, isa=isa)
    out_ref, r_ref = ref.fused_add_rms_norm_ref(x, res, w, 1e-6, zero_centered)
    assert torch.equal(r, r_ref)                          # the rounded sum, bit for bit
    close(out, out_ref, **TOL[dtype])


@isa_param
@DTYPES
def test_gated_rms_norm(dtype, isa, close):
    built(isa)
    x = torch.randn(6, 3, 40).to(dtype)
    gate = head_view(6, 3, 40, dtype)                     # z: a slice of the joined projection
    w = (1 + 0.1 * torch.randn(40)).to(dtype)
    out = decode_ops.gated_rms_norm(x, gate, w, 1e-6, dtype, isa=isa)
    close(out, ref.gated_rms_norm_ref(x, gate, w, 1e-6, dtype), **TOL[dtype])


@isa_param
@DTYPES
@pytest.mark.parametrize("shape", [(3, 74), (2, 5, 32), (1, 2 * 1000)], ids=str)
def test_silu_mul(shape, dtype, isa, close):
    built(isa)
    x = (2 * torch.randn(shape)).to(dtype)
    out = decode_ops.silu_mul(x, isa=isa)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    close(out, silu_mul_ref(x), **TOL[dtype])


def test_comparisons_catch_plausible_bugs(differs):
    """The bf16 tolerance still sees Norm0 applied as plain (w instead of 1 + w), an eps in the
    wrong place, silu(up) * gate, and the gated norm without its gate."""
    built(decode_ops.cpu_isa())
    bf = torch.bfloat16
    x, w = torch.randn(4, 64).to(bf), (0.3 * torch.randn(64)).to(bf)
    out = decode_ops.rms_norm(x, w, 1e-6, True)
    differs(out, ref.rms_norm_ref(x, w, 1e-6, False), **TOL[bf])
    differs(out, ref.rms_norm_ref(x, w, 0.5, True), **TOL[bf])
    g = (2 * torch.randn(3, 64)).to(bf)
    differs(decode_ops.silu_mul(g), F.silu(g[:, 32:]) * g[:, :32], **TOL[bf])
    xg, z = torch.randn(2, 2, 32).to(bf), torch.randn(2, 2, 32).to(bf)
    differs(decode_ops.gated_rms_norm(xg, z, w[:32], 1e-6, bf), ref.rms_norm_ref(xg, w[:32], 1e-6, False),
            **TOL[bf])


def test_rejects_bad_arguments():
    built(decode_ops.cpu_isa())
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="weight has size"):
        decode_ops.rms_norm(x, torch.ones(15), 1e-6, True)
    with pytest.raises(ValueError, match="weight is BFloat16"):
        decode_ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-6, True)
    with pytest.raises(ValueError, match="not supported"):
        decode_ops.rms_norm(x.half(), torch.ones(16).half(), 1e-6, True)
    with pytest.raises(ValueError, match="differ in shape"):
        decode_ops.fused_add_rms_norm(x, torch.randn(3, 8), torch.ones(16), 1e-6, True)
    with pytest.raises(ValueError, match="even"):
        decode_ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="out_dtype"):
        decode_ops.gated_rms_norm(x.view(3, 1, 16), x.view(3, 1, 16), torch.ones(16), 1e-6, torch.bfloat16)


def test_autograd_takes_the_references(monkeypatch):
    """Draft-head training differentiates through the norms and the MLP: with grad enabled and an
    input or weight that requires it, dispatch runs the torch reference and gradients arrive;
    under no_grad (inference) the kernels run."""
    built(decode_ops.cpu_isa())
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    x = torch.randn(3, 16, requires_grad=True)
    w = torch.zeros(16, requires_grad=True)
    y, r = dispatch.fused_add_rms_norm(x, torch.randn(3, 16), w, 1e-6, True)
    (dispatch.rms_norm(y, w, 1e-6, True).sum() + dispatch.silu_mul(r).sum()).backward()
    assert x.grad is not None and w.grad is not None and w.grad.abs().sum() > 0
    assert not dispatch.use_cpu_decode_ops(x, w)
    with torch.no_grad():
        assert dispatch.use_cpu_decode_ops(x, w)
    assert dispatch.use_cpu_decode_ops(x.detach(), w.detach())
