"""The C++ greedy argmax (ops/cpu/argmax.h) against torch.argmax(x, -1): the first index of the
largest value, NaN counting as the largest, on every ISA level, at widths off the vector width
and the chunk size, with the maximum in any chunk and ties across chunks."""

from __future__ import annotations

import pytest
import torch

from backboard.ops import dispatch
from backboard.ops.cpu import decode_ops
from tests.ops.cpu_isas import built, isa_param

CHUNK = 16384          # kArgmaxChunk


@isa_param
@pytest.mark.parametrize("R,V", [(1, 1), (3, 7), (5, 17), (4, CHUNK), (2, CHUNK + 1), (16, 248320)])
def test_random_logits(isa, R, V):
    built(isa)
    x = torch.randn(R, V)
    assert torch.equal(decode_ops.argmax_rows(x, isa=isa), x.argmax(-1))


@isa_param
def test_first_of_equal_maxima_across_chunks_and_in_the_tail(isa):
    built(isa)
    V = 3 * CHUNK + 5
    x = torch.randn(6, V)
    for r, places in enumerate([(5, CHUNK + 3), (2 * CHUNK + 1, 3 * CHUNK + 4), (3 * CHUNK + 4,),
                                (0, 1, 2), (CHUNK - 1, CHUNK), (V - 1,)]):
        x[r, list(places)] = 9.0
    x[3] = -x[3].abs() - 1.0             # all negative but the maxima: a zero-filled tail would win
    x[3, [0, 1, 2]] = -0.5
    out = decode_ops.argmax_rows(x, isa=isa)
    assert out.tolist() == x.argmax(-1).tolist() == [5, 2 * CHUNK + 1, 3 * CHUNK + 4, 0, CHUNK - 1, V - 1]


@isa_param
def test_infinities_and_nan_follow_torch(isa):
    built(isa)
    V = 2 * CHUNK + 9
    x = torch.randn(5, V)
    x[0, CHUNK + 2] = float("inf")
    x[1, [7, CHUNK + 8]] = float("nan")          # NaN beats everything: its first index
    x[1, 3] = float("inf")
    x[2] = float("-inf")                         # all -inf: index 0
    x[3, [4, V - 1]] = float("inf")
    x[4, V - 1] = float("nan")
    assert decode_ops.argmax_rows(x, isa=isa).tolist() == x.argmax(-1).tolist() == [CHUNK + 2, 7, 0, 4, V - 1]


def test_strided_rows_and_bad_input():
    big = torch.randn(4, 1000)
    view = big[:, 10:510]                          # rows 1000 apart
    assert torch.equal(decode_ops.argmax_rows(view), view.argmax(-1))
    with pytest.raises(ValueError, match="float32"):
        decode_ops.argmax_rows(big.bfloat16())
    with pytest.raises(ValueError, match="contiguous rows"):
        decode_ops.argmax_rows(big.t())


def test_dispatch_takes_the_kernel_on_the_cpu(monkeypatch):
    """Greedy sampling (worker/model_runner, sample/rejection) goes through dispatch.argmax."""
    x = torch.randn(3, 500)
    calls = []
    real = decode_ops.argmax_rows
    monkeypatch.setattr(decode_ops, "argmax_rows", lambda t, **kw: calls.append(t.shape) or real(t, **kw))
    assert torch.equal(dispatch.argmax(x), x.argmax(-1)) and calls == [(3, 500)]
    assert torch.equal(dispatch.argmax(x.double()), x.double().argmax(-1)) and len(calls) == 1
