"""The step contract: what one step runs (`StepPlan`, built by `prepare_step` from the scheduler's
output and the persistent InputBatch) and what its sampling produced (`SampleResult`).

The runner's phases and the proposers read these, nothing else of each other. Shapes: B requests
in batch order (group order: plain decodes, then verify groups, then prefills; see
input_batch.group_order), T flat-batch tokens, R logit rows (the flat-batch rows that go through
the LM head: the last row of each sampling request, all 1 + k rows of a verify request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from backboard.core.outputs import SchedulerOutput, TokenLogprobs
from backboard.forward_context import StateSnapshot
from backboard.spec_decode.verify import verify_dst_slots
from backboard.worker.input_batch import InputBatch, StepInputs, build_step, group_order


@dataclass
class StepPlan:
    """One step's requests in batch order, and where their tokens and logit rows sit."""

    req_ids: list[str]                # [B]
    rows: np.ndarray                  # [B] input-batch row of each request
    q_lens: np.ndarray                # [B] tokens computed this step
    num_computed: np.ndarray          # [B] tokens in the caches before this step
    drafts: list[Sequence[int]]       # [B] drafts verified this step (empty: none)
    is_spec: np.ndarray               # [B] bool: the request verifies drafts
    sample_mask: np.ndarray           # [B] bool: the step reaches the last known token, so it samples
    logit_rows: np.ndarray            # [R] flat-batch rows that go through the LM head
    logit_start: np.ndarray           # [B] first logit row of each request (valid where sample_mask)
    inputs: StepInputs                # token ids, positions and ForwardMeta of the flat batch
    verify_dst_slots: list[np.ndarray | None] | None = None  # [B] GDN slot after each verify row
    #                                                           ([1 + k]); None: no verify rows

    @property
    def has_spec(self) -> bool:
        return bool(self.is_spec.any())

    @property
    def num_logits(self) -> np.ndarray:
        """[B] logit rows per request: 1 + k for verify, 1 for a plain sample, 0 mid-prompt."""
        return np.where(self.sample_mask, np.where(self.is_spec, self.q_lens, 1), 0)

    def logit_row_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(req_of [R]: the request of each logit row, choose_pos [R]: the sequence position of
        the token each logit row chooses)."""
        n = self.num_logits
        req_of = np.repeat(np.arange(len(self.rows)), n)
        within = np.arange(len(req_of)) - self.logit_start[req_of]
        end = self.num_computed + self.q_lens - n          # [B] first position a logit row reads
        return req_of, end[req_of] + within + 1


@dataclass
class SampleResult:
    """What the sample phase produced, per request (B)."""

    token_ids: list[list[int]]                       # [B] tokens to append (accepted drafts + one);
    #                                                  [] for a request mid-prompt
    logprobs: list[list[TokenLogprobs] | None]       # [B] one per appended token, when asked for
    num_accepted: np.ndarray                         # [B] drafts accepted (0 without drafts)

    @staticmethod
    def empty(B: int) -> "SampleResult":
        return SampleResult([[] for _ in range(B)], [None] * B, np.zeros(B, dtype=np.int64))


def prepare_step(so: SchedulerOutput, batch: InputBatch, block_size: int,
                 device: torch.device | str) -> StepPlan:
    """The scheduled requests in group order, their drafts written after their known tokens in
    the batch's token buffer, the flat batch built, and the logit rows chosen."""
    req_ids, rows, q_lens, num_computed, drafts, is_spec = _scheduled(so, batch)
    for i in np.nonzero(is_spec)[0]:        # drafts sit after the known tokens (not in num_tokens)
        r, n = rows[i], batch.num_tokens[rows[i]]
        batch.token_ids[r, n:n + len(drafts[i])] = drafts[i]
    qsl = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    pos = np.arange(qsl[-1]) - np.repeat(qsl[:-1] - num_computed, q_lens)
    input_ids = batch.token_ids[np.repeat(rows, q_lens), pos]
    block_table = batch.block_table[rows, :int(batch.num_blocks[rows].max())]
    dst = verify_dst_slots(batch, rows, drafts) if so.spec_decode_tokens else None
    inputs = build_step(input_ids, q_lens, num_computed, block_table, batch.cur_slot[rows], dst, block_size,
                        device)
    if so.state_snapshots:
        inputs.meta.state_snapshots = _snapshots(so.state_snapshots, req_ids, num_computed,
                                                 inputs.meta.prefill_start)
    sample_mask = num_computed + q_lens >= batch.num_tokens[rows]
    plan = StepPlan(req_ids, rows, q_lens, num_computed, drafts, is_spec, sample_mask,
                    np.zeros(0, dtype=np.int64), np.zeros(len(rows), dtype=np.int64), inputs, dst)
    _choose_logit_rows(plan, qsl)
    return plan


def _scheduled(so: SchedulerOutput, batch: InputBatch):
    """(req_ids, rows, q_lens, num_computed, drafts, is_spec) of the scheduled requests, [B] each,
    in group order."""
    nst = so.num_scheduled_tokens
    req_ids = list(nst)
    B = len(req_ids)
    rows = np.fromiter(map(batch.row_of.__getitem__, req_ids), dtype=np.int64, count=B)
    q_lens = np.fromiter(nst.values(), dtype=np.int64, count=B)
    known = dict(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
    known.update((nr.req_id, nr.num_computed_tokens) for nr in so.new_reqs)
    num_computed = np.fromiter(map(known.__getitem__, req_ids), dtype=np.int64, count=B)
    spec = so.spec_decode_tokens
    drafts = [spec.get(r, ()) for r in req_ids] if spec else [()] * B
    is_spec = np.fromiter(map(bool, drafts), dtype=bool, count=B) if spec else np.zeros(B, dtype=bool)
    if not spec and not (q_lens != 1).any():
        return req_ids, rows, q_lens, num_computed, drafts, is_spec     # all decodes: in order
    order = group_order(q_lens, is_spec)
    return ([req_ids[i] for i in order], rows[order], q_lens[order], num_computed[order],
            [drafts[i] for i in order], is_spec[order])


def _snapshots(planned: dict[str, list[tuple[int, int]]], req_ids: list[str], num_computed: np.ndarray,
               prefill_start: int) -> list[StateSnapshot]:
    """The scheduler's (position, slot) per request as (prefill span, offset, slot)."""
    return [StateSnapshot(i - prefill_start, p - int(num_computed[i]), slot)
            for i, rid in enumerate(req_ids) if rid in planned for p, slot in planned[rid]]


def _choose_logit_rows(plan: StepPlan, qsl: np.ndarray) -> None:
    """Each sampling request's last num_logits flat-batch rows go through the LM head."""
    n = plan.num_logits
    np.cumsum(n[:-1], out=plan.logit_start[1:])
    within = np.arange(int(n.sum())) - np.repeat(plan.logit_start, n)
    plan.logit_rows = np.repeat(qsl[1:] - n, n) + within
