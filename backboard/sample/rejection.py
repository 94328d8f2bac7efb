"""Lossless speculative verification (rejection sampling), vectorised over all verify rows.

Request i has L_i = 1 + k_i logit rows: row j < k_i judges draft j, the last row gives the bonus
token. Draft j is accepted with probability min(1, p(d_j) / q(d_j)) (p the target's processed
distribution, q the draft's; q is one-hot for greedy proposers); at the first rejection a token is
drawn from the normalised residual max(p - q, 0); if all k_i are accepted, the bonus token is drawn
from p at the last row. Greedy requests have a one-hot p, so this reduces to "accept while the
draft equals the target's argmax". The output distribution is exactly the target's."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from backboard.ops import dispatch
from backboard.ops.sampling import seeded_noise
from backboard.sample.metadata import SamplingMetadata, SpecDecodeMetadata
from backboard.sample.sampler import Sampler, process_logits, target_probs

_ACCEPT_STREAM = 1 << 40   # offset of the acceptance stream of seeded rows


def rejection_sample(p: torch.Tensor, draft_ids: torch.Tensor, has_draft: torch.Tensor,
                     uniforms: torch.Tensor, draw: Callable[[torch.Tensor], torch.Tensor],
                     draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row. p [R, V] target probs; draft_ids [R] (the draft this row judges; any value where
    has_draft is False); uniforms [R] in [0, 1); draw: normalised probs [R, V] -> one token a row
    (Sampler.draw); draft_probs [R, V] or None (one-hot drafts). Returns accept [R] bool (False
    where no draft) and the token [R] to emit if this row is the first rejected one (residual
    sample) or the bonus row (sample of p)."""
    d = draft_ids.clamp(min=0).long()
    p_d = p.gather(-1, d[:, None])[:, 0]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        q = torch.zeros_like(p).scatter_(-1, d[:, None], 1.0)
    else:
        q = draft_probs
        q_d = q.gather(-1, d[:, None])[:, 0]
    ratio = torch.where(q_d > 0, p_d / q_d.clamp(min=1e-30), torch.ones_like(p_d))
    accept = has_draft & (uniforms < ratio.clamp(max=1.0))
    residual = torch.where(has_draft[:, None], (p - q).clamp(min=0), p)
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    residual = residual / residual.sum(-1, keepdim=True)
    return accept, draw(residual)


def verify_drafts(logits: torch.Tensor, md: SamplingMetadata, spec: SpecDecodeMetadata, sampler: Sampler,
                  draft_probs: torch.Tensor | None = None) -> tuple[dict[int, list[int]], np.ndarray]:
    """Every logit row of a step (logits [R, V]; plain requests have one row and no draft).
    Returns, per request index, the tokens to append (accepted drafts + one) and the accepted
    draft counts [B]."""
    R = logits.shape[0]
    req_of = spec.req_of
    within = np.arange(R) - spec.logit_start[req_of]
    k_of = np.array([len(spec.drafts[i]) for i in req_of], dtype=np.int64)
    has_draft = within < k_of
    draft_ids = np.array([spec.drafts[i][j] if j < k_of[n] else -1
                          for n, (i, j) in enumerate(zip(req_of, within))], dtype=np.int64)
    processed = process_logits(logits, md)
    if md.all_greedy:       # accept while the draft is the argmax; emit the argmax where it stops
        token = dispatch.argmax(processed)
        accept = torch.from_numpy(has_draft).to(token.device) & (token == torch.from_numpy(draft_ids).to(token.device))
        return _collect(spec, accept.tolist(), token.tolist())
    p = target_probs(processed, md)
    u = torch.rand(R, generator=sampler.generator, device=p.device)
    for row, seed, pos in md.seeds or ():
        u[row] = torch.exp(-seeded_noise(seed, pos + _ACCEPT_STREAM, 1, p.device)[0])
    accept, token = rejection_sample(p, torch.from_numpy(draft_ids).to(p.device),
                                     torch.from_numpy(has_draft).to(p.device), u,
                                     lambda probs: sampler.draw(probs, md), draft_probs)
    return _collect(spec, accept.tolist(), token.tolist())


def _collect(spec: SpecDecodeMetadata, accept_l: list[bool], token_l: list[int],
             ) -> tuple[dict[int, list[int]], np.ndarray]:
    """Per request: the leading accepted drafts, then the token of the first row that stops."""
    accepted = np.zeros(len(spec.drafts), dtype=np.int64)
    out: dict[int, list[int]] = {}
    for i in np.unique(spec.req_of):
        s = int(spec.logit_start[i])
        k = len(spec.drafts[i])
        a = 0
        while a < k and accept_l[s + a]:
            a += 1
        accepted[i] = a
        out[int(i)] = list(spec.drafts[i][:a]) + [token_l[s + a]]
    return out, accepted
