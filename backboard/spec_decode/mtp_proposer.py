"""Drafting with an MTP-structured head: the checkpoint's own MTP head (method "mtp") or our
4-bit draft head with its INT8 LM head (method "draft_head").

After every target step:
  catch-up: the head runs over each request's rows of this step whose next token is known
    (row at position i gets embed(t_{i+1}) and the target's hidden h_i), writing its KV cache at
    the same positions as the target (same block table);
  draft 1: from the head's output at the last such row (it predicts the token after the newest);
  drafts 2..k: one decode step of the head per draft, fed its own previous draft and hidden.
Drafts are greedy (the argmax of the head): the rejection sampler treats them as one-hot
proposals, which keeps sampling exact.

Under TP every rank drafts (the embedding and LM head are vocabulary-parallel: collectives). The
MTP head is split as the model's layers are (its KV cache holds this rank's heads); the 4-bit
draft head is whole on every rank (parallel_state.replicated(): no collective inside it, its KV
cache holds every KV head) and gives every rank the same drafts."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from backboard.config import EngineConfig
from backboard.distributed.parallel_state import replicated
from backboard.forward_context import set_forward_context
from backboard.spec_decode.deferred import DeferredSteps
from backboard.spec_decode.draft_vocab import ContextTokens, DraftLMHead
from backboard.spec_decode.proposer import Proposer, ProposerContext
from backboard.worker.input_batch import build_step
from backboard.worker.step import StepPlan

# Deferred rows kept per request: positions further back than this stay holes. The log of steps
# off is a ring of up to max_num_seqs times this plus a step's token budget rows, grown as steps
# off come (64 requests x 512 x hidden 5120 in bf16: 335 MB at most, which the KV planning does
# not count).
DEFERRED_ROWS_MAX = 512


class MTPProposer(Proposer):
    num_extra_attn_layers = 1

    def __init__(self, cfg: EngineConfig) -> None:
        super().__init__(cfg)
        self.head = None
        self.draft_lm: DraftLMHead | None = None    # the head's hidden -> draft token ids
        self.context: ContextTokens | None = None   # over a draft vocabulary: the requests' own words
        self.replicated = cfg.spec.method == "draft_head"
        sc = cfg.scheduler
        cap = min(sc.max_model_len, DEFERRED_ROWS_MAX)
        self.deferred = DeferredSteps(cap, sc.max_num_seqs * cap + sc.max_num_batched_tokens)
        if self.replicated:                 # whole under TP: a cache of every KV head
            self.extra_attn_kv_heads = cfg.model.num_key_value_heads

    def bind(self, ctx: ProposerContext) -> None:
        super().bind(ctx)
        mc = self.cfg.model
        attn_idx = len(mc.attn_layer_ids)
        dev = str(ctx.device)
        if self.cfg.spec.method == "mtp":
            from backboard.models.mtp import load_mtp_head

            self.head = load_mtp_head(mc, ctx.dtype, attn_idx, dev)
            self.draft_lm = DraftLMHead(ctx.compute_logits)
        else:
            from backboard.spec_decode.draft_head import load_draft_head

            self.head, self.draft_lm = load_draft_head(
                self.cfg.spec.draft_model, mc, ctx.dtype, ctx.lm_head_weight, ctx.compute_logits, attn_idx, dev,
                int8_lm_head=self.cfg.spec.int8_lm_head)
        if self.draft_lm.size is not None and self.draft_lm.rows is not None:
            self.context = ContextTokens(self.draft_lm.token_ids, mc.vocab_size)

    # ---------------------------------------------------------------------------------------
    def _forward(self, ids: np.ndarray, hidden: torch.Tensor, q_lens: np.ndarray, num_computed: np.ndarray,
                 rows: np.ndarray) -> torch.Tensor:
        """The head over a flat batch: ids [T], hidden [T, H]; requests (input-batch rows) with
        q_lens rows each starting at num_computed. Returns the head's hidden [T, H]."""
        ctx = self.ctx
        b = ctx.batch
        block_table = b.block_table[rows, :int(b.num_blocks[rows].max())]
        step = build_step(ids, q_lens, num_computed, block_table, np.zeros(len(rows), dtype=np.int64),
                          None, ctx.block_size, ctx.device)
        with set_forward_context(step.meta, ctx.caches):
            embeds = ctx.embed(step.input_ids)          # vocabulary-parallel: on every rank
            with replicated() if self.replicated else nullcontext():
                return self.head(embeds, hidden.to(ctx.dtype), step.meta.positions)

    def _known_rows(self, plan: StepPlan) -> np.ndarray:
        """[B] rows of this step per request whose next token is known (the head's inputs)."""
        n_after = self.ctx.batch.num_tokens[plan.rows]
        return np.minimum(plan.q_lens, n_after - 1 - plan.num_computed)

    def _rows_of(self, plan: StepPlan, hidden: torch.Tensor, i: int, v: int) -> torch.Tensor:
        qsl = plan.inputs.query_start_loc
        return hidden[int(qsl[i]):int(qsl[i]) + int(v)]

    @torch.inference_mode()
    def defer(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Speculation is off this step: keep the target's hidden states of the rows the head
        would have caught up on (DeferredSteps: one copy a step into its ring), so that turning it
        back on fills the head's cache instead of leaving holes that every later draft of the
        request attends over."""
        qsl = plan.inputs.query_start_loc
        self.deferred.add(plan.req_ids, plan.num_computed, self._known_rows(plan), qsl[:-1], hidden)

    def forget(self) -> None:
        self.deferred.clear()

    @torch.inference_mode()
    def catch_up(self, plan: StepPlan, hidden: torch.Tensor) -> int:
        b = self.ctx.batch
        cur = self._known_rows(plan)                    # this step's rows, then the deferred ones before them
        pend = self.deferred.take(plan.req_ids, plan.num_computed) if self.deferred.steps else [None] * len(cur)
        pend = [p if c > 0 else None for p, c in zip(pend, cur)]
        start = np.array([nc - (0 if p is None else len(p)) for nc, p in zip(plan.num_computed, pend)], dtype=np.int64)
        v = cur + plan.num_computed - start
        tok_rows = np.repeat(plan.rows, v)
        pos = np.concatenate([np.arange(start[i], start[i] + v[i]) for i in range(len(v))])
        ids = b.token_ids[tok_rows, pos + 1]
        # batch order of the catch-up: requests keep the target's order (v may differ from q)
        parts = []
        for i in range(len(v)):
            parts += ([pend[i]] if pend[i] is not None else []) + [self._rows_of(plan, hidden, i, cur[i])]
        h = torch.cat(parts)
        order = np.argsort(v != 1, kind="stable")       # one-row requests first (uniform group)
        if not np.all(order == np.arange(len(v))):
            starts = np.concatenate([[0], np.cumsum(v)[:-1]])
            perm = np.concatenate([np.arange(starts[i], starts[i] + v[i]) for i in order])
            ids, h = ids[perm], h[torch.from_numpy(perm).to(h.device)]
            v_o, nc_o, rows_o = v[order], start[order], plan.rows[order]
        else:
            v_o, nc_o, rows_o = v, start, plan.rows
        out = self._forward(ids, h, v_o, nc_o, rows_o)
        # the head's output at each request's last caught-up row (the source of draft 1)
        ends = np.cumsum(v_o) - 1
        last = out[torch.from_numpy(ends).to(out.device)]
        self._last_hidden = torch.empty_like(last)
        self._last_hidden[torch.from_numpy(order).to(out.device)] = last
        self._last_pos = start + v - 1                                  # [B] position of that row
        return int(v.sum())

    def _context_tokens(self, plan: StepPlan, who: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Over a draft vocabulary: the drafted requests' context tokens outside it, drafted over
        too (DraftLMHead.extra), else None."""
        if self.context is None:
            return None
        b = self.ctx.batch
        self.context.keep_only(plan.req_ids)
        ids = self.context.union([plan.req_ids[i] for i in who],
                                 [b.token_ids[r, :b.num_tokens[r]] for r in plan.rows[who]])
        return self.draft_lm.extra(ids)

    @torch.inference_mode()
    def draft(self, plan: StepPlan, hidden: torch.Tensor, k: int, who: np.ndarray) -> list[list[int]]:
        h = self._last_hidden[torch.from_numpy(who).to(self._last_hidden.device)]
        pos = self._last_pos[who]
        rows = plan.rows[who]
        drafts = []
        extra = self._context_tokens(plan, who)
        tok = self.draft_lm(h, extra)                                     # draft 1
        drafts.append(tok)
        for j in range(1, k):
            ones = np.ones(len(who), dtype=np.int64)
            h = self._forward(tok.cpu().numpy(), h, ones, pos + j, rows)
            tok = self.draft_lm(h, extra)
            drafts.append(tok)
        return torch.stack(drafts, dim=1).tolist()
