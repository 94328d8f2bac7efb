"""int8 / int4 weight formats (ops/quant.py) and the Triton weight-only matmuls against them."""

from __future__ import annotations

import pytest
import torch

from backboard.ops import quant
from backboard.ops.triton import quant_gemm as qg


# ---- the torch side: formats, quantizers, references ------------------------------------------
def test_int4_packing_layout():
    """Element 2j in the low nibble, 2j + 1 in the high nibble, stored as q + 8."""
    w = torch.tensor([[-7.0, 0.0, 3.5, 7.0]])                      # one group of 4, scale 1
    packed, scales = quant.quantize_int4(w, group_size=4)
    assert scales.tolist() == [[1.0]]
    # q = [-7, 0, 4 (round half to even), 7] -> u = [1, 8, 12, 15]
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x81, 0xFC]]
    assert quant.dequantize_int4(packed, scales, 4).tolist() == [[-7.0, 0.0, 4.0, 7.0]]


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_error(group):
    w = torch.randn(24, 256)
    packed, scales = quant.quantize_int4(w, group)
    assert packed.shape == (24, 128) and scales.shape == (24, 256 // group)
    err = (quant.dequantize_int4(packed, scales, group) - w).abs()
    step = scales.repeat_interleave(group, dim=1)
    assert torch.all(err <= step / 2 + 1e-6)                         # within half a step
    # values on the grid come back exactly
    again = quant.dequantize_int4(*quant.quantize_int4(quant.dequantize_int4(packed, scales, group), group), group)
    torch.testing.assert_close(again, quant.dequantize_int4(packed, scales, group))


@pytest.mark.parametrize("group", [32, 64])
def test_fake_quant_int4_is_the_stored_values_with_straight_through_gradient(group):
    """Quantization-aware training reads the values the saved int4 head will hold: on each group's
    grid of 16 steps (a zero group stays zero), within half a step of w; the gradient reaches the
    float weights unchanged."""
    w = torch.randn(6, 128)
    w[2, :group] = 0
    w.requires_grad_(True)
    wq = quant.fake_quant_int4(w, group)
    step = (w.detach().reshape(6, -1, group).abs().amax(-1, keepdim=True) / 7.0)
    q = wq.detach().reshape(6, -1, group) / torch.where(step > 0, step, torch.ones_like(step))
    assert torch.allclose(q, q.round(), atol=1e-4) and q.round().min() >= -8 and q.round().max() <= 7
    assert (wq.detach()[2, :group] == 0).all()
    assert ((wq.detach() - w.detach()).reshape(6, -1, group).abs() <= step / 2 + 1e-6).all()
    assert not torch.equal(wq.detach(), w.detach())
    g = torch.randn_like(w)
    wq.backward(g)
    assert torch.equal(w.grad, g)


def test_int8_round_trip_and_zero_rows():
    w = torch.randn(10, 64)
    w[3] = 0
    q, scale = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale[3] == 0
    err = (quant.dequantize_int8(q, scale) - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-7)
    y = quant.int8_linear_ref(torch.randn(2, 64), q, scale)
    assert torch.all(y[:, 3] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_references_equal_dequantize_then_matmul(dtype, close, monkeypatch):
    w, x = torch.randn(50, 128), torch.randn(3, 128).to(dtype)
    q, s = quant.quantize_int8(w)
    p, sc = quant.quantize_int4(w, 32, scale_dtype=torch.bfloat16)
    want8 = (x.float() @ quant.dequantize_int8(q, s).t()).to(dtype)
    want4 = (x.float() @ quant.dequantize_int4(p, sc, 32).t()).to(dtype)
    close(quant.int8_linear_ref(x, q, s), want8, dtype)
    close(quant.int4_linear_ref(x, p, sc, 32), want4, dtype)
    monkeypatch.setattr(quant, "_SLAB_ELEMS", 128 * 7)                # slabs of 7 rows
    close(quant.int8_linear_ref(x, q, s), want8, dtype)
    close(quant.int4_linear_ref(x, p, sc, 32), want4, dtype)


def test_quantizers_reject_bad_arguments():
    with pytest.raises(ValueError, match="group_size"):
        quant.quantize_int4(torch.randn(4, 96), 64)
    with pytest.raises(ValueError, match="2-D float"):
        quant.quantize_int8(torch.randint(0, 4, (4, 8)))
    with pytest.raises(ValueError, match="K="):
        quant.int8_linear_ref(torch.randn(2, 7), *quant.quantize_int8(torch.randn(4, 8)))


# ---- the Triton kernels ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M,K", [(1, 256), (5, 200), (33, 256)])
def test_int8_linear(M, K, dtype, close):
    w = torch.randn(70, K)                                           # N not a tile multiple
    q, s = quant.quantize_int8(w)
    x = torch.randn(M, K).to(dtype)
    out = qg.int8_linear(x, q, s)
    assert out.shape == (M, 70) and out.dtype == dtype
    close(out, quant.int8_linear_ref(x, q, s), dtype, rtol=2e-2 if dtype != torch.float32 else 1e-5,
          atol=0.3 if dtype != torch.float32 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_int4_linear(group, dtype, close):
    w = torch.randn(70, 256)
    p, s = quant.quantize_int4(w, group)
    x = torch.randn(5, 256).to(dtype)
    out = qg.int4_linear(x, p, s, group)
    close(out, quant.int4_linear_ref(x, p, s, group), dtype, rtol=2e-2 if dtype != torch.float32 else 1e-5,
          atol=0.3 if dtype != torch.float32 else 1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("M", [1, 20])
def test_split_k(kind, M, close):
    """Few output tiles for the SMs (N = 70 on 4 stand-in SMs): K is split and the fp32 partials
    summed; the result is the same matmul."""
    N, K = 70, 1024
    w, x = torch.randn(N, K), torch.randn(M, K)
    BM, BN, BK, _ = qg.gemv_tiles(M, x.dtype)
    split, per = qg.plan_split_k(-(-N // BN) * -(-M // BM), K, BK, x.device)
    assert split > 1 and per % BK == 0 and split * per >= K
    if kind == "int8":
        q, s = quant.quantize_int8(w)
        out, ref = qg.int8_linear(x, q, s), quant.int8_linear_ref(x, q, s)
    else:
        p, s = quant.quantize_int4(w, 64)
        out, ref = qg.int4_linear(x, p, s, 64), quant.int4_linear_ref(x, p, s, 64)
    close(out, ref, torch.float32, rtol=1e-5, atol=1e-4)


def test_int4_group_not_a_power_of_two(close):
    """G = 96 (a multiple of 32): K tiles of 32, three per group."""
    w, x = torch.randn(70, 384), torch.randn(3, 384)
    p, s = quant.quantize_int4(w, 96)
    close(qg.int4_linear(x, p, s, 96), quant.int4_linear_ref(x, p, s, 96), torch.float32,
          rtol=1e-5, atol=1e-4)


def test_int8_bf16_activations_fp32_output(close):
    q, s = quant.quantize_int8(torch.randn(70, 256))
    x = torch.randn(3, 256).to(torch.bfloat16)
    out = qg.int8_linear(x, q, s, torch.float32)
    assert out.dtype == torch.float32
    close(out, quant.int8_linear_ref(x, q, s, torch.float32), torch.float32, rtol=1e-5, atol=1e-4)


def test_int8_lm_head_takes_model_dtype_activations(monkeypatch, close):
    """The draft LM head feeds bf16 hidden states to the int8 GEMV (no fp32 copy: the fp32 FMA
    path spills on a GPU) and still returns fp32 logits, exactly x.float() @ w^T."""
    from backboard.layers.linear import Int8Linear
    from backboard.ops import dispatch
    lm = Int8Linear.from_weight(torch.randn(70, 64))
    seen = []
    real = dispatch.int8_linear
    monkeypatch.setattr(dispatch, "int8_linear", lambda x, *a: seen.append(x.dtype) or real(x, *a))
    x = torch.randn(3, 64).to(torch.bfloat16)
    y = lm(x)
    assert seen == [torch.bfloat16] and y.dtype == torch.float32
    close(y, x.float() @ quant.dequantize_int8(lm.qweight, lm.scales).t(), torch.float32,
          rtol=1e-5, atol=1e-4)


def test_comparisons_catch_plausible_bugs(differs):
    w, x = torch.randn(40, 128), torch.randn(3, 128)
    p, s = quant.quantize_int4(w, 32)
    swapped = ((p & 0xF) << 4) | (p >> 4)                           # nibble order reversed
    differs(qg.int4_linear(x, p, s, 32), quant.int4_linear_ref(x, swapped, s, 32), atol=1e-4, rtol=1e-5)
    q, sc = quant.quantize_int8(w)
    differs(qg.int8_linear(x, q, sc), x @ q.float().t(), atol=1e-4, rtol=1e-5)   # scale forgotten


def test_kernels_reject_bad_arguments():
    x = torch.randn(2, 256)
    q, s = quant.quantize_int8(torch.randn(8, 256))
    p, sc = quant.quantize_int4(torch.randn(8, 256), 64)
    with pytest.raises(ValueError, match="group_size"):
        qg.int4_linear(x, p, sc, 48)                                 # not a multiple of 32
    with pytest.raises(ValueError, match="scales"):
        qg.int4_linear(x, p, sc[:, :2].contiguous(), 64)
    with pytest.raises(ValueError, match="int8"):
        qg.int8_linear(x, q.to(torch.int16), s)
    with pytest.raises(ValueError, match="shape"):
        qg.int8_linear(x[:, :128], q, s)
    with pytest.raises(ValueError, match="contiguous"):
        qg.int8_linear(x, q.t().contiguous().t(), s)
