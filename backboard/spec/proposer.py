"""What every proposer shares: choosing k (adaptive), who gets drafts, caps, and statistics."""

from __future__ import annotations

import time

import numpy as np

from backboard.config import EngineConfig
from backboard.spec.adaptive import AdaptiveK


class Proposer:
    num_extra_attn_layers = 0      # attention KV caches the proposer needs (sharing block tables)

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.k_max = cfg.spec.num_speculative_tokens
        self.adaptive = AdaptiveK(self.k_max, enabled=cfg.spec.adaptive)
        self.runner = None
        self.last_k = self.k_max
        self._last_draft_s: float | None = None

    def attach(self, runner) -> None:
        self.runner = runner

    # subclasses ---------------------------------------------------------------------------
    def catch_up(self, plan, hidden) -> None:
        """Keep the proposer's own caches in step with the target's (every step, any k)."""

    def draft(self, plan, hidden, k: int, who: np.ndarray) -> list[list[int]]:
        """Up to k drafts for each request index in `who` (batch order)."""
        raise NotImplementedError

    # the step ------------------------------------------------------------------------------
    def propose(self, plan, hidden, sampled: list[list[int]], accepted: np.ndarray, k_max: int,
                verify_s: float) -> list[list[int]]:
        self._observe(plan, accepted, verify_s)
        t0 = time.perf_counter()
        self.catch_up(plan, hidden)
        B = len(plan.rows)
        who = np.array([i for i in range(B) if sampled[i]], dtype=np.int64)
        k = min(k_max, self.adaptive.choose(len(who))) if len(who) else 0
        self.last_k = k
        out: list[list[int]] = [[] for _ in range(B)]
        if k > 0 and len(who):
            room = self._room(plan, who)
            keep = who[room > 0]
            if len(keep):
                drafts = self.draft(plan, hidden, min(k, int(room.max())), keep)
                for i, d, r in zip(keep, drafts, room[room > 0]):
                    out[i] = [int(t) for t in d[:int(r)]]
            self._last_draft_s = (time.perf_counter() - t0) / max(k, 1)
            self._last_draft_n = len(who)
        return out

    def _room(self, plan, who: np.ndarray) -> np.ndarray:
        """Drafts each request can still use: the context and max_tokens leave room for the
        drafts plus the bonus token."""
        b, a = self.runner.batch, self.runner.params.a
        rows = plan.rows[who]
        n = b.num_tokens[rows]
        ctx_room = self.cfg.scheduler.max_model_len - n - 1
        out_room = a["max_tokens"][rows] - (n - b.num_prompt[rows]) - 1
        return np.minimum(np.minimum(ctx_room, out_room), self.k_max).astype(np.int64)

    def _observe(self, plan, accepted: np.ndarray, verify_s: float) -> None:
        lens = np.array([len(d) for d in plan.drafts], dtype=np.int64)
        reached = [int(np.sum((lens > j) & (accepted >= j))) for j in range(self.k_max)]
        acc = [int(np.sum((lens > j) & (accepted > j))) for j in range(self.k_max)]
        rows = int(plan.q_lens.sum())
        self.adaptive.observe(rows, verify_s, getattr(self, "_last_draft_n", 0), self._last_draft_s,
                              reached, acc)
        self._last_draft_s = None
