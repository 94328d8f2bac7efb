"""The sampler: logits + per-row parameters -> token ids (and logprobs of the raw distribution).

Order of processing (as in vLLM): min_tokens masking, penalties, then greedy rows take the argmax;
random rows: temperature, min_p, top_k / top_p, then the draw: on the CPU the inverse CDF at one
uniform a row (with temperature alone, fused with the softmax), on GPUs the exponential race with
per-row noise (seeded rows: their uniform or noise from (seed, position) alone)."""

from __future__ import annotations

import numpy as np
import torch

from backboard.constants import GREEDY_TEMPERATURE
from backboard.core.outputs import TokenLogprobs
from backboard.ops import dispatch
from backboard.ops.sampling import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    exponential_race,
    seeded_noise,
    seeded_uniform,
)
from backboard.sample.metadata import SamplingMetadata


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits the choice is made from (before temperature)."""
    if md.min_tokens_mask:
        logits = logits.clone()
        for row, ids in md.min_tokens_mask:
            logits[row, ids] = float("-inf")
    if md.repetition is not None:
        logits = apply_penalties(logits, md.prompt_mask, md.output_counts, md.repetition,
                                 md.presence, md.frequency)
    return logits


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from: softmax of the processed, tempered, truncated
    logits. Greedy rows get a one-hot at their argmax. [R, V] fp32."""
    greedy = md.temperature < GREEDY_TEMPERATURE
    temp = torch.where(greedy, torch.ones_like(md.temperature), md.temperature)
    x = logits / temp[:, None]
    if md.min_p is not None:
        x = apply_min_p(x, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        x = apply_top_k_top_p(x, md.top_k, md.top_p)
    probs = x.softmax(-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, dispatch.argmax(logits)[:, None], 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def draw(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """One token a row, row r's with probability probs[r] (rows sum to 1). [R, V] -> [R]. On
        the CPU the inverse CDF at one uniform a row (the exponential race's V exponentials took
        3.5 ms a row of a 248K vocabulary there); on GPUs the race (parallel there)."""
        R, V = probs.shape
        if probs.device.type == "cpu":
            return dispatch.sample_inverse_cdf(probs, self.uniforms(R, md, probs.device))
        return exponential_race(probs, self.noise(R, V, md, probs.device))

    def uniforms(self, R: int, md: SamplingMetadata, device) -> torch.Tensor:
        """[R] fp64 in [0, 1); seeded rows from (seed, position) alone."""
        u = torch.rand(R, dtype=torch.float64, generator=self.generator, device=device)
        for row, seed, pos in md.seeds or ():
            u[row] = seeded_uniform(seed, pos, device)[0]
        return u

    def noise(self, R: int, V: int, md: SamplingMetadata, device) -> torch.Tensor:
        """[R, V] Exp(1); seeded rows from (seed, position) alone."""
        q = torch.empty(R, V, device=device).exponential_(generator=self.generator)
        for row, seed, pos in md.seeds or ():
            q[row] = seeded_noise(seed, pos, V, device)
        return q

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits [R, V] fp32 -> token ids [R]."""
        processed = process_logits(logits, md)
        if md.all_greedy:
            return dispatch.argmax(processed)
        if processed.device.type == "cpu" and md.top_k is None and md.top_p is None and md.min_p is None:
            return self._draw_tempered(processed, md)
        return self.draw(target_probs(processed, md), md)

    def _draw_tempered(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature alone, on the CPU: softmax and draw in one op (the probabilities never
        written: torch's softmax over [16, 248K] took ~4 ms of a decode step). Greedy rows of a
        mixed batch take their argmax."""
        greedy = md.temperature < GREEDY_TEMPERATURE
        inv_t = torch.where(greedy, torch.ones_like(md.temperature), 1.0 / md.temperature)
        ids = dispatch.sample_logits(logits, inv_t, self.uniforms(logits.shape[0], md, logits.device))
        return torch.where(greedy, dispatch.argmax(logits), ids) if bool(greedy.any()) else ids


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int],
                     ) -> list[TokenLogprobs | None]:
    """Logprobs of the raw model distribution: for row r with num_top[r] >= 0, the chosen
    token's logprob and rank and the top-n. logits [R, V]; token_ids [R]."""
    rows = [r for r, n in enumerate(num_top) if n >= 0]
    out: list[TokenLogprobs | None] = [None] * len(num_top)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = token_ids[idx].long()
    chosen_lp = lp.gather(-1, chosen[:, None])[:, 0]
    ranks = (lp > chosen_lp[:, None]).sum(-1) + 1
    n_max = max(num_top[r] for r in rows)
    top_v, top_i = lp.topk(n_max, dim=-1) if n_max > 0 else (None, None)
    chosen_l, chosen_lp_l, ranks_l = chosen.tolist(), chosen_lp.tolist(), ranks.tolist()
    top_vl = top_v.tolist() if top_v is not None else None
    top_il = top_i.tolist() if top_i is not None else None
    for j, r in enumerate(rows):
        n = num_top[r]
        top = tuple(zip(top_il[j][:n], top_vl[j][:n])) if n > 0 else ()
        out[r] = TokenLogprobs(chosen_l[j], chosen_lp_l[j], ranks_l[j], top)
    return out


def sampled_logprobs(logits: torch.Tensor, tokens: dict[int, list[int]], logit_start: np.ndarray,
                     num_logprobs: list[int]) -> dict[int, list[TokenLogprobs]]:
    """Logprobs of each request's new tokens from its logit rows: request i's tokens were chosen
    at rows logit_start[i].. (logits [R, V]; num_logprobs [R] as in compute_logprobs). Requests
    that asked for none are left out."""
    chosen = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    for i, toks in tokens.items():
        s = logit_start[i]
        chosen[s:s + len(toks)] = torch.tensor(toks)
    all_lps = compute_logprobs(logits, chosen, num_logprobs)
    return {i: all_lps[logit_start[i]:logit_start[i] + len(toks)] for i, toks in tokens.items()
            if all_lps[logit_start[i]] is not None}
