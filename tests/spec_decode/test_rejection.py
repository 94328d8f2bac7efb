"""Rejection sampling keeps the target distribution exactly (and a wrong rule is caught)."""

from __future__ import annotations

import math

import pytest
import torch

from backboard.ops import dispatch
from backboard.ops.sampling import exponential_race
from backboard.sample.rejection import rejection_sample

V, N = 6, 60000


def _draw(kind, g):
    """Sampler.draw's two forms: the exponential race (GPUs) and the inverse CDF (the CPU)."""
    if kind == "race":
        return lambda probs: exponential_race(probs, torch.empty(probs.shape).exponential_(generator=g))
    return lambda probs: dispatch.sample_inverse_cdf(
        probs, torch.rand(probs.shape[0], dtype=torch.float64, generator=g))


def _trial(p, q, accept_rule=None, seed=0, draft_probs=True, draw="race"):
    g = torch.Generator().manual_seed(seed)
    P = p.expand(N, V).contiguous()
    Q = q.expand(N, V).contiguous()
    d = torch.multinomial(Q, 1, generator=g)[:, 0]
    u = torch.rand(N, generator=g)
    ones = torch.ones(N, dtype=torch.bool)
    if accept_rule is None:
        acc, tok = rejection_sample(P, d, ones, u, _draw(draw, g), Q if draft_probs else None)
    else:
        _, tok = rejection_sample(P, d, ones, u, _draw(draw, g), Q)
        acc = accept_rule(P, Q, d, u)
    out = torch.where(acc, d, tok)
    return torch.bincount(out, minlength=V).double() / N, acc.double().mean().item()


def _chi2(freq, p):
    chi2 = float((N * (freq - p.double()) ** 2 / p.double()).sum())
    return chi2 < (V - 1) + 6 * math.sqrt(2 * (V - 1)) + 10


@pytest.mark.parametrize("draw", ["race", "cdf"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_output_distribution_is_the_target(seed, draw):
    g = torch.Generator().manual_seed(100 + seed)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    freq, acc_rate = _trial(p, q, seed=seed, draw=draw)
    assert _chi2(freq, p), (freq, p)
    # the acceptance rate is sum_x min(p, q) (the standard result)
    assert abs(acc_rate - float(torch.minimum(p, q).sum())) < 0.01


def test_one_hot_drafts_keep_the_target():
    """Greedy proposers (argmax drafts, q one-hot) under sampling: still exactly p."""
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(V, generator=g), -1)
    q = torch.zeros(V)
    q[2] = 1.0
    for draw in ("race", "cdf"):
        freq, acc_rate = _trial(p, q, draft_probs=False, draw=draw)
        assert _chi2(freq, p) and abs(acc_rate - float(p[2])) < 0.01


def test_a_wrong_acceptance_rule_fails():
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    wrong = [lambda P, Q, d, u: torch.ones_like(u, dtype=torch.bool),                  # always accept
             lambda P, Q, d, u: u < P.gather(1, d[:, None])[:, 0],                      # ignores q
             lambda P, Q, d, u: u < (Q.gather(1, d[:, None]) / P.gather(1, d[:, None]))[:, 0].clamp(max=1)]
    for rule in wrong:
        freq, _ = _trial(p, q, accept_rule=rule)
        assert not _chi2(freq, p)


def test_greedy_rows_accept_exactly_the_argmax():
    p = torch.zeros(3, V)
    p[torch.arange(3), torch.tensor([1, 4, 0])] = 1.0
    d = torch.tensor([1, 3, 0])
    acc, tok = rejection_sample(p, d, torch.tensor([True, True, False]), torch.rand(3),
                                _draw("cdf", torch.Generator().manual_seed(0)))
    assert acc.tolist() == [True, False, False]
    assert tok[1] == 4 and tok[2] == 0      # correction = argmax; bonus row = argmax
