"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (longest n first). Needs no model."""

from __future__ import annotations

import numpy as np
import torch

from backboard.config import EngineConfig
from backboard.spec_decode.proposer import Proposer
from backboard.worker.step import StepPlan


def ngram_lookup(seq: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """seq [N] -> up to k drafts (possibly none)."""
    N = len(seq)
    for n in range(min(n_max, N - 1), n_min - 1, -1):
        pattern = seq[N - n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:N - 1], n)   # starts 0..N-1-n
        hits = np.nonzero(np.all(windows == pattern, axis=1))[0]
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    num_extra_attn_layers = 0

    def __init__(self, cfg: EngineConfig) -> None:
        super().__init__(cfg)
        self.n_min, self.n_max = cfg.spec.ngram_min, cfg.spec.ngram_max

    def draft(self, plan: StepPlan, hidden: torch.Tensor, k: int, who: np.ndarray) -> list[list[int]]:
        b = self.ctx.batch
        out = []
        for i in who:
            row = plan.rows[i]
            out.append(ngram_lookup(b.token_ids[row, :b.num_tokens[row]], k, self.n_min, self.n_max))
        return out
