"""What every proposer shares: the context it works in, choosing k (adaptive), who gets drafts,
caps, and statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from backboard.config import EngineConfig
from backboard.distributed.parallel_state import broadcast_object
from backboard.forward_context import ModelCaches
from backboard.spec_decode.adaptive import AdaptiveK
from backboard.worker.input_batch import InputBatch
from backboard.worker.step import SampleResult, StepPlan


def running_only(state: dict, req_ids: list[str]) -> dict:
    """Per-request state without the requests not in req_ids (finished, aborted, preempted); the
    same dict when none is to go (the common step)."""
    keep = set(req_ids)
    return state if all(r in keep for r in state) else {r: v for r, v in state.items() if r in keep}


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may use of the runner (the runner builds it once; the proposer reads the
    batch state and never writes it)."""

    batch: InputBatch                                       # token ids, block tables, lengths by row
    max_tokens: np.ndarray                                  # [max_reqs] each row's max_tokens
    caches: ModelCaches                                     # shared; the head writes its own layers
    embed: Callable[[torch.Tensor], torch.Tensor]           # token ids [T] -> [T, H]
    compute_logits: Callable[[torch.Tensor], torch.Tensor]  # hidden [R, H] -> fp32 logits [R, V]
    lm_head_weight: torch.Tensor                            # [V, H]
    block_size: int
    device: torch.device
    dtype: torch.dtype                                      # the target's


class Proposer:
    num_extra_attn_layers = 0      # attention KV caches the proposer needs (sharing block tables)
    extra_attn_kv_heads: int | None = None   # KV heads of those caches (None: this rank's share)

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.k_max = cfg.spec.num_speculative_tokens
        self.adaptive = AdaptiveK(self.k_max, enabled=cfg.spec.adaptive)
        self.ctx: ProposerContext | None = None
        self.last_k = self.k_max
        self.k_steps = np.zeros(self.k_max + 1, dtype=np.int64)    # steps that chose each k (statistics)
        self._last_step: tuple[float, int] | None = None           # (start of propose, requests)
        self._caught_up = 0                                         # rows the last propose caught up

    def bind(self, ctx: ProposerContext) -> None:
        """Called once by the runner, after its caches exist."""
        self.ctx = ctx

    # subclasses ---------------------------------------------------------------------------
    def catch_up(self, plan: StepPlan, hidden: torch.Tensor) -> int:
        """Keep the proposer's own caches in step with the target's (every step, any k).
        hidden [T, H]: the target's final hidden states of this step's flat batch. Returns the
        rows it ran (0 for a proposer without a model: n-gram)."""
        return 0

    def defer(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Speculation is off this step (no catch-up): keep what a later catch-up needs (nothing
        for a proposer without a model)."""

    def forget(self) -> None:
        """Speculation is off and probes keep confirming it (AdaptiveK.dormant): drop what defer
        kept; a later catch-up starts from its own step (the positions before stay holes)."""

    def draft(self, plan: StepPlan, hidden: torch.Tensor, k: int, who: np.ndarray) -> list[list[int]]:
        """Up to k drafts for each request index in `who` (batch order)."""
        raise NotImplementedError

    # the step ------------------------------------------------------------------------------
    def propose(self, plan: StepPlan, hidden: torch.Tensor, result: SampleResult, k_max: int,
                verify_s: float) -> list[list[int]]:
        """[B] drafts for the next step (up to k_max each; [] for none)."""
        decode = not np.any(~plan.is_spec & (plan.q_lens > 1))     # no prompt rows in the step
        self._observe(plan, result.num_accepted, verify_s, decode)
        B = len(plan.rows)
        out: list[list[int]] = [[] for _ in range(B)]
        who = np.array([i for i in range(B) if result.token_ids[i]], dtype=np.int64)
        self._observe_step(plan, result, len(who), decode)
        k = min(k_max, self.adaptive.choose(len(who))) if len(who) else 0
        dormant = k == 0 and self.adaptive.dormant(len(who))
        if self.num_extra_attn_layers:      # a model-based proposer's collectives: rank 0's choice (timed) on all
            k, dormant = broadcast_object((k, dormant))
        self.last_k = k
        self.k_steps[k] += 1
        if k == 0:                          # speculation off this step: no head work
            if dormant:
                self.forget()               # off for good here: its upkeep is not paid either
            else:
                self.defer(plan, hidden)    # its inputs kept for the next catch-up
            return out
        t0 = time.perf_counter()
        caught_up = self._caught_up = self.catch_up(plan, hidden)
        t1 = time.perf_counter()
        room = self._room(plan, who)
        keep = who[room > 0]
        if len(keep):
            drafts = self.draft(plan, hidden, min(k, int(room.max())), keep)
            for i, d, r in zip(keep, drafts, room[room > 0]):
                out[i] = [int(t) for t in d[:int(r)]]
        self.adaptive.observe_draft(len(who), caught_up, t1 - t0, (time.perf_counter() - t1) / k)
        self.adaptive.observe_coverage(sum(1 for d in out if d), len(who))
        return out

    def _room(self, plan: StepPlan, who: np.ndarray) -> np.ndarray:
        """Drafts each request can still use: the context and max_tokens leave room for the
        drafts plus the bonus token."""
        b = self.ctx.batch
        rows = plan.rows[who]
        n = b.num_tokens[rows]
        ctx_room = self.cfg.scheduler.max_model_len - n - 1
        out_room = self.ctx.max_tokens[rows] - (n - b.num_prompt[rows]) - 1
        return np.minimum(np.minimum(ctx_room, out_room), self.k_max).astype(np.int64)

    def _observe_step(self, plan: StepPlan, result: SampleResult, n: int, decode: bool) -> None:
        """The whole step that just ended, from the previous propose to this one (its drafting,
        the scheduler, the forward, sampling, the output): counted when it was a steady decode step,
        the same requests as the one before and no prompt rows (those cost differently, and
        after an idle engine the gap is not a step's cost)."""
        now, last = time.perf_counter(), self._last_step
        self._last_step = (now, n)
        steady = decode and last is not None and last[1] == n == len(plan.rows)
        steady = steady and self._caught_up <= n * (self.k_max + 1)   # not a catch-up over an off stretch
        self._caught_up = 0
        if steady and n:
            k = max(map(len, plan.drafts), default=0) if plan.has_spec else 0
            self.adaptive.observe_step(n, k, now - last[0], sum(map(len, result.token_ids)))

    def _observe(self, plan: StepPlan, accepted: np.ndarray, verify_s: float, decode: bool) -> None:
        spec = plan.has_spec
        if spec:
            lens = np.fromiter(map(len, plan.drafts), dtype=np.int64, count=len(plan.drafts))
            self.adaptive.observe_acceptance(
                [int(np.sum((lens > j) & (accepted >= j))) for j in range(self.k_max)],
                [int(np.sum((lens > j) & (accepted > j))) for j in range(self.k_max)])
        if decode:                                          # decode / verify rows only
            self.adaptive.observe_verify(int(plan.q_lens.sum()), verify_s, spec)
