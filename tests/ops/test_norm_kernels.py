"""RMSNorm, fused residual add + RMSNorm, gated RMSNorm and SiLU-mul kernels against torch."""

from __future__ import annotations

import pytest
import torch

from backboard.ops.activation import silu_mul_ref
from backboard.ops.norm import fused_add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref
from backboard.ops.triton import activation as tact
from backboard.ops.triton import norm as tn

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("zc", [True, False], ids=["zero-centred", "plain"])
def test_rms_norm(dtype, zc, close):
    x = torch.randn(7, 48).to(dtype)                                # N not a power of two
    w = (0.1 * torch.randn(48)).to(dtype)
    close(tn.rms_norm(x, w, 1e-6, zc), rms_norm_ref(x, w, 1e-6, zc), dtype)


def test_rms_norm_on_head_views(close):
    """q_norm on the query half of interleaved [query | gate] heads: a strided 3-D view."""
    qg = torch.randn(5, 3, 2 * 16)
    q = qg[..., :16]                                                 # [T, nh, D], strides (96, 32, 1)
    w = 0.1 * torch.randn(16)
    out = tn.rms_norm(q, w, 1e-6, True)
    assert out.shape == q.shape
    close(out, rms_norm_ref(q, w, 1e-6, True))


@DTYPES
@pytest.mark.parametrize("zc", [True, False], ids=["zero-centred", "plain"])
def test_fused_add_rms_norm(dtype, zc, close):
    x, res = torch.randn(6, 40).to(dtype), torch.randn(6, 40).to(dtype)
    w = (0.1 * torch.randn(40)).to(dtype)
    out, new_res = tn.fused_add_rms_norm(x, res, w, 1e-6, zc)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6, zc)
    close(out, ref_out, dtype)
    close(new_res, ref_res, dtype)
    assert torch.equal(res, res.clone())                             # inputs left alone


@DTYPES
def test_gated_rms_norm(dtype, close):
    T, nh, N = 5, 3, 20
    core = torch.randn(T, nh, N)                                     # fp32 core output
    proj = torch.randn(T, 2 * nh * N).to(dtype)
    z = proj[:, nh * N:].reshape(T, nh, N)                           # a view of the projection
    w = (1 + 0.1 * torch.randn(N)).to(dtype)
    close(tn.gated_rms_norm(core, z, w, 1e-6, dtype), gated_rms_norm_ref(core, z, w, 1e-6, dtype), dtype)


@DTYPES
def test_silu_mul(dtype, close):
    x = torch.randn(6, 2 * 37).to(dtype)                             # odd I
    close(tact.silu_mul(x), silu_mul_ref(x), dtype)


def test_comparisons_catch_plausible_bugs(differs):
    x, res = torch.randn(6, 40), torch.randn(6, 40)
    w = 0.1 * torch.randn(40)
    out, _ = tn.fused_add_rms_norm(x, res, w, 1e-6, True)
    differs(out, fused_add_rms_norm_ref(x, res, w, 1e-6, False)[0])   # w instead of 1 + w
    differs(out, rms_norm_ref(x, w, 1e-6, True))                          # residual not added
    gu = torch.randn(4, 2 * 24)
    differs(tact.silu_mul(gu), silu_mul_ref(torch.cat([gu[:, 24:], gu[:, :24]], 1)))  # gate/up swapped


def test_launchers_reject_bad_arguments():
    x = torch.randn(4, 32)
    w = torch.randn(32)
    with pytest.raises(ValueError, match="must end in a dim of 32"):
        tn.rms_norm(torch.randn(4, 31), w, 1e-6, True)
    with pytest.raises(ValueError, match="contiguous last dim"):
        tn.rms_norm(torch.randn(32, 4).t(), w, 1e-6, True)
    with pytest.raises(ValueError, match="differ in shape"):
        tn.fused_add_rms_norm(x, torch.randn(3, 32), w, 1e-6, True)
    with pytest.raises(ValueError, match="share a dtype"):
        tn.fused_add_rms_norm(x, x.bfloat16(), w, 1e-6, True)
    with pytest.raises(ValueError, match="even last dim"):
        tact.silu_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="dtype"):
        tact.silu_mul(torch.randint(0, 3, (3, 8)))
    with pytest.raises(ValueError, match="gate"):
        tn.gated_rms_norm(torch.randn(2, 3, 8), torch.randn(2, 3, 4), torch.randn(8), 1e-6, torch.float32)
