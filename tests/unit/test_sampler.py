"""The sampler on a tiny vocabulary: each transform gives the right distribution (chi-square
tests that a wrong implementation fails), and the parameters are validated."""

from __future__ import annotations

import math

import pytest
import torch

from backboard.ops.sampling import apply_penalties, apply_top_k_top_p
from backboard.sample.metadata import SamplingMetadata
from backboard.sample.sampler import Sampler
from backboard.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N = 40000


def _freqs(md_kw, logits=LOGITS, n=N, seed=0):
    R = n
    md = SamplingMetadata(temperature=torch.full((R,), md_kw.pop("temperature", 1.0)), all_greedy=False,
                          **{k: (torch.full((R,), v) if not isinstance(v, torch.Tensor) else v)
                             for k, v in md_kw.items()})
    ids = Sampler(seed)(logits.expand(R, -1).clone(), md)
    return torch.bincount(ids, minlength=logits.numel()).double() / R


def _expected(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    p = torch.softmax(logits / temperature, -1).double()
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k:
        keep &= p >= p.topk(top_k).values[-1]
    if min_p:
        keep &= p >= min_p * p.max()
    q = torch.where(keep, p, torch.zeros_like(p))
    q /= q.sum()
    if top_p < 1.0:
        order = q.argsort(descending=True)
        cum = q[order].cumsum(0)
        k = int((cum < top_p).sum()) + 1          # smallest set with mass >= top_p
        mask = torch.zeros_like(q, dtype=torch.bool)
        mask[order[:k]] = True
        q = torch.where(mask, q, torch.zeros_like(q))
        q /= q.sum()
    return q


def _chi2_ok(freq, expected, n=N):
    """Pearson chi-square at a generous threshold, plus zero mass where expected is zero."""
    if torch.any((expected == 0) & (freq > 0)):
        return False
    m = expected > 0
    chi2 = float((n * (freq[m] - expected[m]) ** 2 / expected[m]).sum())
    dof = int(m.sum()) - 1
    return chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 10


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.0),
    dict(top_k=3), dict(top_p=0.7), dict(min_p=0.2), dict(top_k=5, top_p=0.8, temperature=0.7),
])
def test_distribution(kw):
    exp_kw = dict(kw)
    md_kw = dict(kw)
    if "top_k" in md_kw:
        md_kw["top_k"] = torch.full((N,), md_kw["top_k"], dtype=torch.int64)
    freq = _freqs(md_kw)
    assert _chi2_ok(freq, _expected(LOGITS, **exp_kw)), (freq, _expected(LOGITS, **exp_kw))


def test_the_check_catches_a_wrong_distribution():
    """The test above can fail: temperature 0.5 is not temperature 1."""
    freq = _freqs(dict(temperature=0.5))
    assert not _chi2_ok(freq, _expected(LOGITS, temperature=1.0))
    freq = _freqs(dict(top_k=torch.full((N,), 3, dtype=torch.int64)))
    assert not _chi2_ok(freq, _expected(LOGITS, top_k=4))


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50)
    md = SamplingMetadata(temperature=torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]), all_greedy=False)
    ids = Sampler(0)(logits, md)
    assert torch.equal(ids[::2], logits[::2].argmax(-1))


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 100)
    def draw(R, row):
        big = torch.randn(R, 100)
        big[row] = logits[0]
        md = SamplingMetadata(temperature=torch.ones(R), all_greedy=False, seeds=[(row, 1234, 17)])
        return int(Sampler(R)(big, md)[row])
    assert len({draw(1, 0), draw(5, 3), draw(9, 8)}) == 1
    # and different positions give different draws (over many positions)
    md_tokens = set()
    for pos in range(30):
        md = SamplingMetadata(temperature=torch.ones(1), all_greedy=False, seeds=[(0, 1234, pos)])
        md_tokens.add(int(Sampler(0)(logits.clone(), md)[0]))
    assert len(md_tokens) > 5


def test_top_k_top_p_keep_at_least_one():
    x = apply_top_k_top_p(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([1]), torch.tensor([0.01]))
    assert torch.isfinite(x).sum() == 1 and x[0, 1] == 5.0


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.3]])
    prompt = torch.tensor([[True, False, False, False]])
    counts = torch.tensor([[0.0, 2.0, 0.0, 0.0]])
    out = apply_penalties(logits, prompt, counts, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    # token 0: in the prompt, positive -> /2; token 1: output twice, negative -> *2, -0.25*2, -0.5
    assert torch.allclose(out, torch.tensor([[1.0, -2.0 - 0.5 - 0.5, 0.5, 0.3]]))


@pytest.mark.parametrize("bad,name", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=-1), "min_tokens"), (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(seed=-3), "seed"), (dict(stop=[""]), "stop"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(temperature="hot"), "temperature"),
])
def test_invalid_params_name_the_parameter(bad, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)
