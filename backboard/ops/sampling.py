"""Sampling as short pure functions over logits [R, V] (fp32)."""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    ) -> torch.Tensor:
    """vLLM / OpenAI semantics. prompt_mask [R, V] bool (token in the prompt); output_counts [R, V]
    (occurrences in the output); penalties [R].
    repetition: for tokens seen in prompt or output, logit / p if logit > 0 else logit * p;
    frequency: logit -= f * count; presence: logit -= p * (count > 0)."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None].expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (the top probability). min_p [R]."""
    probs = logits.softmax(-1)
    thresh = probs.amax(-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < thresh, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """top_k [R] (0 = off), top_p [R] (1 = off). Keeps at least one token per row."""
    V = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, V), top_k).clamp(max=V)
        kth = sorted_logits.gather(-1, (V - k).long()[:, None])          # the k-th largest value
        mask |= sorted_logits < kth
    if top_p is not None:
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(-1)
        cum = probs.cumsum(-1)
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False
        mask |= drop
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample i with probability probs[i] as argmax(probs / q), q ~ Exp(1) i.i.d. [R]."""
    return (probs / noise).argmax(-1)


def sample_inverse_cdf_ref(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample i with probability probs[i] / sum(probs) as the first index whose running sum (fp64)
    exceeds u * sum: probs [R, V] >= 0, u [R] fp64 in [0, 1) -> int64 [R]. One uniform a row (the
    exponential race needs V exponentials). A row without a positive finite sum: its argmax."""
    c = probs.double().cumsum(-1)
    total = c[:, -1]
    idx = torch.searchsorted(c, (u.double() * total)[:, None], right=True)[:, 0].clamp(max=probs.shape[1] - 1)
    bad = ~(torch.isfinite(total) & (total > 0))
    return torch.where(bad, probs.argmax(-1), idx)


def sample_logits_ref(logits: torch.Tensor, inv_t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw of softmax(logits * inv_t) at u (sample_inverse_cdf_ref), in one op where a kernel
    fuses it: logits [R, V] fp32, inv_t [R], u [R] fp64 -> int64 [R]. A row whose maximum is not
    finite (a NaN, +inf, or only -inf) gets its argmax."""
    x = logits.float()
    m = x.max(-1, keepdim=True).values
    probs = torch.exp((x - m) * inv_t[:, None].float())
    ids = sample_inverse_cdf_ref(probs, u)
    bad = ~torch.isfinite(m[:, 0])                  # max is NaN when any logit is
    return torch.where(bad, x.argmax(-1), ids)


def seeded_uniform(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fp64 uniform in [0, 1) that depends only on (seed, position), as seeded_noise. [1]"""
    return torch.rand(1, dtype=torch.float64, generator=_seeded_generator(seed, position, device), device=device)


def _seeded_generator(seed: int, position: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63))
    return g


def seeded_noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) noise that depends only on (seed, position): the same token whatever else is in
    the batch, across preemption and speculative decoding."""
    g = _seeded_generator(seed, position, device)
    return torch.empty(vocab, device=device).exponential_(generator=g)
