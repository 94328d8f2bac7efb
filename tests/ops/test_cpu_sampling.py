"""The C++ draw of random sampling (ops/cpu/sampling.h) against its torch reference
(ops.sampling.sample_inverse_cdf_ref: the first index whose fp64 running sum exceeds u * sum), on
every ISA level, at widths off the chunk size; never a zero-probability token; rows without a
positive finite sum take their argmax; and the draws follow the distribution."""

from __future__ import annotations

import math

import pytest
import torch

from backboard.ops import dispatch
from backboard.ops.cpu import decode_ops
from backboard.ops.cpu.build import cpu_isa
from backboard.ops.sampling import sample_inverse_cdf_ref, sample_logits_ref
from tests.ops.cpu_isas import built, isa_param

CHUNK = 4096           # kCdfChunk


def _probs(R, V, seed=0, zero_share=0.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(R, V, generator=g) * 2, -1)
    if zero_share:
        p[torch.rand(R, V, generator=g) < zero_share] = 0.0      # top-k / top-p truncation
    return p


@isa_param
@pytest.mark.parametrize("R,V", [(1, 1), (3, 7), (4, CHUNK), (2, CHUNK + 1), (5, 3 * CHUNK + 17), (16, 248320)])
def test_matches_the_reference(isa, R, V):
    built(isa)
    p = _probs(R, V, seed=V, zero_share=0.3 if V > 7 else 0.0)
    for seed in range(3):
        u = torch.rand(R, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        got = decode_ops.sample_inverse_cdf(p, u, isa=isa)
        assert got.tolist() == sample_inverse_cdf_ref(p, u).tolist()
        assert bool((p.gather(1, got[:, None]) > 0).all())            # never a zero-probability token


@isa_param
def test_ends_unnormalised_rows_and_rows_without_mass(isa):
    built(isa)
    V = 2 * CHUNK + 9
    p = torch.zeros(6, V)
    p[0, [3, CHUNK + 5]] = 1.0                      # u = 0: the first positive entry
    p[1, [3, CHUNK + 5]] = 1.0                      # u just below 1: the last positive entry
    p[2, V - 1] = 7.0                               # unnormalised, one entry in the tail
    p[3] = 0.0                                      # no mass: the argmax (index 0)
    p[4, 11] = float("nan")                         # NaN: the argmax (torch: the NaN)
    p[5, [CHUNK - 1, CHUNK]] = 0.5                  # u = 0.5 exactly on the boundary: the second
    u = torch.tensor([0.0, 1 - 1e-12, 0.3, 0.6, 0.2, 0.5], dtype=torch.float64)
    got = decode_ops.sample_inverse_cdf(p, u, isa=isa).tolist()
    assert got == sample_inverse_cdf_ref(p, u).tolist() == [3, CHUNK + 5, V - 1, 0, 11, CHUNK]


def test_bad_arguments_are_refused():
    built(cpu_isa())
    with pytest.raises(ValueError, match="float64"):
        decode_ops.sample_inverse_cdf(torch.rand(2, 5), torch.rand(2))
    with pytest.raises(ValueError, match="float32"):
        decode_ops.sample_inverse_cdf(torch.rand(2, 5, dtype=torch.float64), torch.rand(2, dtype=torch.float64))


def test_draws_follow_the_distribution_and_a_shifted_draw_is_caught():
    """100k draws of one 50-token distribution through dispatch (the kernel where built): a
    chi-square test passes; the same draws read one index off fail it."""
    V, N = 50, 100_000
    p = _probs(1, V, seed=3)[0]
    u = torch.rand(N, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids = dispatch.sample_inverse_cdf(p.expand(N, V).contiguous(), u)
    freq = torch.bincount(ids, minlength=V).double() / N
    shifted = torch.bincount((ids + 1) % V, minlength=V).double() / N

    def chi2_ok(f):
        m = p.double() > 5 / N
        return float((N * (f[m] - p.double()[m]) ** 2 / p.double()[m]).sum()) < V + 6 * math.sqrt(2 * V) + 10

    assert chi2_ok(freq) and not chi2_ok(shifted)


# ---- temperature alone, fused with the softmax (sample_logits) ----------------------------------
@isa_param
@pytest.mark.parametrize("R,V", [(1, 1), (3, 7), (4, CHUNK), (2, CHUNK + 1), (5, 3 * CHUNK + 17), (16, 248320)])
def test_fused_softmax_draw_matches_the_reference(isa, R, V):
    built(isa)
    g = torch.Generator().manual_seed(V)
    x = torch.randn(R, V, generator=g) * 3
    x[torch.rand(R, V, generator=g) < 0.2] = float("-inf")          # masked tokens (a grammar, min_tokens)
    x[:, 0] = 1.0                                                    # never a row of only -inf
    inv_t = torch.rand(R, generator=g) * 2 + 0.2
    for seed in range(3):
        u = torch.rand(R, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        got = decode_ops.sample_logits(x, inv_t, u, isa=isa)
        ref = sample_logits_ref(x, inv_t, u)
        # exps differ from torch's by an ulp: a draw within ~1e-6 of a boundary may differ (none here)
        assert got.tolist() == ref.tolist()
        assert bool(torch.isfinite(x.gather(1, got[:, None])).all())          # never a masked token


@isa_param
def test_fused_draw_rows_without_a_finite_maximum_take_their_argmax(isa):
    built(isa)
    V = CHUNK + 3
    x = torch.randn(3, V)
    x[0, CHUNK + 1] = float("nan")
    x[1, 5] = float("inf")
    x[2] = float("-inf")
    u = torch.full((3,), 0.5, dtype=torch.float64)
    got = decode_ops.sample_logits(x, torch.ones(3), u, isa=isa).tolist()
    assert got == sample_logits_ref(x, torch.ones(3), u).tolist() == [CHUNK + 1, 5, 0]


def test_fused_draws_follow_the_tempered_distribution():
    V, N, T = 40, 100_000, 0.7
    x = torch.randn(V, generator=torch.Generator().manual_seed(4)) * 2
    p = torch.softmax(x / T, -1).double()
    u = torch.rand(N, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ids = dispatch.sample_logits(x.expand(N, V).contiguous(), torch.full((N,), 1 / T), u)
    for shift, ok in ((0, True), (1, False)):
        f = torch.bincount((ids + shift) % V, minlength=V).double() / N
        m = p > 5 / N
        chi2 = float((N * (f[m] - p[m]) ** 2 / p[m]).sum())
        assert (chi2 < V + 6 * math.sqrt(2 * V) + 10) == ok
