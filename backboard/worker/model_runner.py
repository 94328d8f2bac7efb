"""SchedulerOutput -> flat batch -> forward -> sampler -> ModelRunnerOutput.

The common path only: speculative decoding (spec/), GDN state slots (the metadata here, the math
in layers/) and CUDA graphs (worker/cuda_graph.py) live in their own modules."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from backboard.config import EngineConfig
from backboard.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from backboard.core.state_pool import verify_slot_order
from backboard.models.loader import load_model, torch_dtype
from backboard.sample.rejection import verify_drafts
from backboard.sample.sampler import Sampler, SamplingMetadata, compute_logprobs
from backboard.worker.cache_ops import apply_cache_copies
from backboard.worker.forward_context import set_forward_context
from backboard.worker.input_batch import InputBatch, StepInputs, build_step, group_order
from backboard.worker.memory import allocate_caches, plan_cache, profile_activation_bytes

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One step's requests in batch order."""

    req_ids: list[str]
    rows: np.ndarray              # [B] input-batch rows
    q_lens: np.ndarray            # [B]
    num_computed: np.ndarray      # [B] before this step
    drafts: list[list[int]]       # [B] drafts verified this step ([] for none)
    is_spec: np.ndarray           # [B] bool: has drafts
    samples: np.ndarray           # [B] bool: the step reaches the end of the known tokens
    logit_rows: np.ndarray        # flat token rows that go through the LM head
    logit_start: np.ndarray       # [B] first logit row of each request (valid where samples)
    inputs: StepInputs
    spec_dst: list | None = None  # [B] verify destination slots per row (None: no verify rows)

    @property
    def has_spec(self) -> bool:
        return bool(self.is_spec.any())

    @property
    def n_logits(self) -> np.ndarray:
        """[B] logit rows per request: 1 + k for verify, 1 for a plain sample, 0 mid-prompt."""
        return np.where(self.samples, np.where(self.is_spec, self.q_lens, 1), 0)


class SamplingParamsTable:
    """Per-row sampling parameters as arrays, so a step gathers them with one fancy index."""

    FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition", "presence", "frequency",
              "seed", "logprobs", "prompt_logprobs", "min_tokens", "max_tokens")

    def __init__(self, max_reqs: int) -> None:
        self.a = {f: np.zeros(max_reqs, dtype=np.float64) for f in self.FIELDS}
        self.eos: list[list[int]] = [[] for _ in range(max_reqs)]
        # rows that need nothing but an argmax (greedy; no penalties, min_tokens or logprobs)
        self.plain_greedy = np.zeros(max_reqs, dtype=bool)

    def set(self, row: int, sp, eos_token_ids) -> None:
        a = self.a
        a["temperature"][row] = sp.temperature
        a["top_k"][row] = sp.top_k
        a["top_p"][row] = sp.top_p
        a["min_p"][row] = sp.min_p
        a["repetition"][row] = sp.repetition_penalty
        a["presence"][row] = sp.presence_penalty
        a["frequency"][row] = sp.frequency_penalty
        a["seed"][row] = -1 if sp.seed is None else sp.seed
        a["logprobs"][row] = -1 if sp.logprobs is None else sp.logprobs
        a["prompt_logprobs"][row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        a["min_tokens"][row] = sp.min_tokens
        a["max_tokens"][row] = sp.max_tokens if sp.max_tokens is not None else 1 << 40
        self.eos[row] = sorted(set(eos_token_ids) | set(sp.stop_token_ids or ()))
        self.plain_greedy[row] = (sp.greedy and not sp.needs_penalties and sp.min_tokens == 0
                                  and sp.logprobs is None)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, proposer=None) -> None:
        self.cfg = cfg
        mc = cfg.model
        self.device = torch.device(cfg.device)
        self.dtype = torch_dtype(mc.dtype)
        t0 = time.time()
        self.model = load_model(mc, str(self.device))
        self.load_time_s = time.time() - t0
        self.proposer = proposer
        extra = proposer.num_extra_attn_layers if proposer is not None else 0
        act = None
        if self.device.type == "cuda" and cfg.cache.num_kv_blocks is None:
            try:
                act = profile_activation_bytes(self.model, cfg, self.dtype, self.device)
            except Exception as e:  # noqa: BLE001 - fall back to the estimate, say so
                logger.warning("profiling pass failed (%s: %s); sizing the cache from an estimate",
                               type(e).__name__, e)
        self.num_blocks, self.num_slots = plan_cache(cfg, self.dtype, self.device, extra, act)
        self.block_size = cfg.cache.block_size
        use_graphs = self.device.type == "cuda" and not cfg.enforce_eager and mc.num_experts == 0
        # with graphs, one more block (never handed out) takes the padding rows' KV writes
        self.caches = allocate_caches(mc, self.num_blocks + int(use_graphs), self.block_size,
                                      self.num_slots, self.dtype, self.device, extra_attn_layers=extra)
        sc = cfg.scheduler
        k = cfg.num_spec_tokens
        # + 2k: verify rows and the proposer's lookahead KV writes (see Scheduler.lookahead)
        max_blocks = -(-(sc.max_model_len + 2 * k + 1) // self.block_size)
        self.batch = InputBatch(sc.max_num_seqs, sc.max_model_len + k, max_blocks, 1 + k)
        self.params = SamplingParamsTable(sc.max_num_seqs)
        self.sampler = Sampler(cfg.seed, self.device)
        self.vocab_size = mc.vocab_size
        if proposer is not None:
            proposer.attach(self)
        self.graphs = self._capture_graphs(max_blocks) if use_graphs else None

    def _capture_graphs(self, max_blocks: int):
        from backboard.worker.cuda_graph import CudaGraphRunner

        sc, k = self.cfg.scheduler, self.cfg.num_spec_tokens
        graphs = CudaGraphRunner(
            self.model, self.caches, Ls=[1] + ([1 + k] if k else []), max_rows=256,
            max_reqs=sc.max_num_seqs, max_blocks=max_blocks, max_seq_len=sc.max_model_len + 2 * k + 1,
            block_size=self.block_size, scratch_block=self.num_blocks, scratch_slot=self.num_slots,
            device=self.device)
        try:
            graphs.capture()
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: fall back to eager
            logger.warning("CUDA graph capture failed (%s: %s); running eagerly", type(e).__name__, e)
            return None
        return graphs

    # ---- the step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.kv_block_copies or so.state_copies:       # prefix caching: before anything is written
            apply_cache_copies(self.caches, so.kv_block_copies, so.state_copies)
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput([], [], [])
        plan = self._prepare_inputs(so)
        t0 = time.perf_counter()
        hidden = self._forward(plan.inputs)
        rows = plan.logit_rows
        # a decode step needs every row: no gather
        h = hidden if len(rows) == hidden.shape[0] else hidden[torch.from_numpy(rows).to(self.device)]
        logits = self.model.compute_logits(h)
        sampled, lps, accepted = self._sample(plan, logits)
        prompt_lps = self._prompt_logprobs(plan, hidden)
        out = self._commit(plan, sampled, lps, accepted, prompt_lps)
        step_s = time.perf_counter() - t0
        out.verify_time_s = step_s if plan.has_spec else 0.0
        if self.proposer is not None:
            t1 = time.perf_counter()
            out.spec_token_ids = self.proposer.propose(plan, hidden, sampled, accepted,
                                                       so.num_spec_tokens, step_s)
            out.draft_time_s = time.perf_counter() - t1
        return out

    # ---- phases --------------------------------------------------------------------------
    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs.meta):
            return self.graphs.run(inputs.input_ids, inputs.meta)
        with set_forward_context(inputs.meta, self.caches):
            return self.model(inputs.input_ids, inputs.meta.positions)

    def _update_states(self, so: SchedulerOutput) -> None:
        b = self.batch
        for rid in so.finished_req_ids:
            b.remove(rid)
        for nr in so.new_reqs:
            row = b.add(nr.req_id, nr.token_ids, nr.num_prompt_tokens, nr.block_ids, nr.state_slots)
            self.params.set(row, nr.sampling_params, nr.eos_token_ids)
        cr = so.cached_reqs
        for rid, blocks in zip(cr.req_ids, cr.new_block_ids):
            if blocks:
                b.append_blocks(b.row_of[rid], blocks)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepPlan:
        b = self.batch
        nst = so.num_scheduled_tokens
        req_ids = list(nst)
        B = len(req_ids)
        rows = np.fromiter(map(b.row_of.__getitem__, req_ids), dtype=np.int64, count=B)
        q_lens = np.fromiter(nst.values(), dtype=np.int64, count=B)
        known = dict(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
        known.update((nr.req_id, nr.num_computed_tokens) for nr in so.new_reqs)
        num_computed = np.fromiter(map(known.__getitem__, req_ids), dtype=np.int64, count=B)
        spec = so.spec_decode_tokens
        drafts = [spec.get(r, ()) for r in req_ids] if spec else [()] * B
        is_spec = np.fromiter(map(bool, drafts), dtype=bool, count=B) if spec else np.zeros(B, dtype=bool)
        if spec or (q_lens != 1).any():          # group order: decodes, verify groups, prefills
            order = group_order(q_lens, is_spec)
            req_ids = [req_ids[i] for i in order]
            drafts = [drafts[i] for i in order]
            rows, q_lens, num_computed, is_spec = rows[order], q_lens[order], num_computed[order], is_spec[order]
        # drafts sit after the known tokens in the token buffer (not counted in num_tokens)
        for i in np.nonzero(is_spec)[0]:
            r, n = rows[i], b.num_tokens[rows[i]]
            b.token_ids[r, n:n + len(drafts[i])] = drafts[i]
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        pos = np.arange(qsl[-1]) - np.repeat(qsl[:-1] - num_computed, q_lens)
        input_ids = b.token_ids[np.repeat(rows, q_lens), pos]
        block_table = b.block_table[rows, :int(b.num_blocks[rows].max())]
        spec_dst = [self._verify_slots(rows[i], len(drafts[i]) + 1) if is_spec[i] else None
                    for i in range(B)] if spec else None
        inputs = build_step(input_ids, q_lens, num_computed, block_table, b.cur_slot[rows], spec_dst,
                            self.block_size, self.device)
        samples = num_computed + q_lens >= b.num_tokens[rows]
        plan = StepPlan(req_ids, rows, q_lens, num_computed, drafts, is_spec, samples,
                        np.zeros(0, dtype=np.int64), np.zeros(B, dtype=np.int64), inputs, spec_dst)
        # rows of the LM head: each sampling request's last n_logits tokens
        n_logits = plan.n_logits
        np.cumsum(n_logits[:-1], out=plan.logit_start[1:])
        within = np.arange(int(n_logits.sum())) - np.repeat(plan.logit_start, n_logits)
        plan.logit_rows = np.repeat(qsl[1:] - n_logits, n_logits) + within
        return plan

    def _verify_slots(self, row: int, L: int) -> np.ndarray:
        """Destination slot of the state after each verify row (core/state_pool.verify_slot_order:
        the scheduler follows the same rule to know which slot holds a request's state)."""
        if self.caches.conv is None:                  # no GDN layers: nothing to place
            return np.zeros(L, dtype=np.int64)
        return np.array(verify_slot_order(self.batch.state_slots[row].tolist(), int(self.batch.cur_slot[row]), L))

    def _sampling_metadata(self, plan: StepPlan) -> tuple[SamplingMetadata, np.ndarray]:
        """Metadata for every logit row; also the row -> request index map."""
        n_logits = plan.n_logits
        req_of = np.repeat(np.arange(len(plan.rows)), n_logits)
        brow = plan.rows[req_of]
        a = self.params.a
        dev = self.device
        temp = a["temperature"][brow]
        md = SamplingMetadata(temperature=torch.tensor(temp, dtype=torch.float32, device=dev),
                              all_greedy=bool(np.all(temp < 1e-5)))
        # position of the token each logit row chooses
        within = np.arange(len(req_of)) - plan.logit_start[req_of]
        choose_pos = plan.num_computed[req_of] + plan.q_lens[req_of] - n_logits[req_of] + within + 1
        if not md.all_greedy:
            if np.any(a["top_k"][brow] > 0):
                md.top_k = torch.tensor(a["top_k"][brow], dtype=torch.int64, device=dev)
            if np.any(a["top_p"][brow] < 1.0):
                md.top_p = torch.tensor(a["top_p"][brow], dtype=torch.float32, device=dev)
            if np.any(a["min_p"][brow] > 0.0):
                md.min_p = torch.tensor(a["min_p"][brow], dtype=torch.float32, device=dev)
            seeded = np.nonzero((a["seed"][brow] >= 0) & (temp >= 1e-5))[0]
            md.seeds = [(int(i), int(a["seed"][brow[i]]), int(choose_pos[i])) for i in seeded]
        if np.any((a["repetition"][brow] != 1) | (a["presence"][brow] != 0) | (a["frequency"][brow] != 0)):
            self._penalty_metadata(md, brow, choose_pos)
        n_out = choose_pos - self.batch.num_prompt[brow]      # outputs before this token
        need_min = np.nonzero(n_out < a["min_tokens"][brow])[0]
        if len(need_min):
            md.min_tokens_mask = [(int(i), self.params.eos[brow[i]]) for i in need_min
                                  if self.params.eos[brow[i]]]
        md.num_logprobs = a["logprobs"][brow].astype(np.int64).tolist()
        return md, req_of

    def _penalty_metadata(self, md: SamplingMetadata, brow: np.ndarray, choose_pos: np.ndarray) -> None:
        b, a, V, dev = self.batch, self.params.a, self.vocab_size, self.device
        R = len(brow)
        prompt_mask = torch.zeros(R, V, dtype=torch.bool)
        counts = torch.zeros(R, V, dtype=torch.float32)
        for i in range(R):   # one row per request with penalties: not per token
            r, npr, end = brow[i], b.num_prompt[brow[i]], choose_pos[i]
            prompt_mask[i, torch.from_numpy(b.token_ids[r, :npr])] = True
            out = torch.from_numpy(b.token_ids[r, npr:end])
            counts[i].index_add_(0, out, torch.ones(len(out)))
        md.prompt_mask, md.output_counts = prompt_mask.to(dev), counts.to(dev)
        md.repetition = torch.tensor(a["repetition"][brow], dtype=torch.float32, device=dev)
        md.presence = torch.tensor(a["presence"][brow], dtype=torch.float32, device=dev)
        md.frequency = torch.tensor(a["frequency"][brow], dtype=torch.float32, device=dev)

    def _sample(self, plan: StepPlan, logits: torch.Tensor):
        """-> per request: sampled token lists, logprobs lists, number of accepted drafts."""
        B = len(plan.rows)
        sampled: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[TokenLogprobs] | None] = [None] * B
        accepted = np.zeros(B, dtype=np.int64)
        if len(plan.logit_rows) == 0:
            return sampled, lps, accepted
        if not plan.has_spec and self.params.plain_greedy[plan.rows[plan.samples]].all():
            # the common case needs nothing but an argmax per request
            for i, t in zip(np.nonzero(plan.samples)[0].tolist(), logits.argmax(-1).tolist()):
                sampled[i] = [t]
            return sampled, lps, accepted
        md, req_of = self._sampling_metadata(plan)
        if plan.has_spec:
            tokens, accepted = verify_drafts(logits, md, req_of, plan, self.sampler)
        else:
            ids = self.sampler(logits, md).tolist()
            tokens = {int(req_of[j]): [ids[j]] for j in range(len(ids))}
        for i, toks in tokens.items():
            sampled[i] = toks
        if any(n >= 0 for n in md.num_logprobs):
            chosen = torch.zeros(len(req_of), dtype=torch.int64, device=logits.device)
            for i, toks in tokens.items():
                s = plan.logit_start[i]
                chosen[s:s + len(toks)] = torch.tensor(toks)
            all_lps = compute_logprobs(logits, chosen, md.num_logprobs)
            for i, toks in tokens.items():
                s = plan.logit_start[i]
                if all_lps[s] is not None:
                    lps[i] = all_lps[s:s + len(toks)]
        return sampled, lps, accepted

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> dict[str, list]:
        """For requests with prompt_logprobs: logprobs of prompt tokens 1.. computed this step."""
        b, a = self.batch, self.params.a
        out: dict[str, list] = {}
        if plan.inputs.meta.prefill_start == len(plan.rows) and not plan.has_spec and plan.samples.all():
            return out                            # a decode-only step has no prompt rows
        want = np.nonzero(a["prompt_logprobs"][plan.rows] >= 0)[0]
        qsl = plan.inputs.query_start_loc
        for i in want:
            row, nc, q = plan.rows[i], plan.num_computed[i], plan.q_lens[i]
            npr = int(b.num_prompt[row])
            last = min(nc + q, npr - 1)          # positions nc .. last-1 predict prompt tokens
            if last <= nc:
                continue
            h = hidden[qsl[i]:qsl[i] + (last - nc)]
            nxt = torch.from_numpy(b.token_ids[row, nc + 1:last + 1]).to(self.device)
            n = int(a["prompt_logprobs"][row])
            out[plan.req_ids[i]] = compute_logprobs(self.model.compute_logits(h), nxt, [n] * len(nxt))
        return out

    def _commit(self, plan: StepPlan, sampled, lps, accepted, prompt_lps) -> ModelRunnerOutput:
        """Write the new tokens into the batch; move GDN state pointers past accepted drafts."""
        b = self.batch
        if not plan.has_spec:                     # one token per sampling request
            idx = np.nonzero(plan.samples)[0]
            rows = plan.rows[idx]
            b.token_ids[rows, b.num_tokens[rows]] = [sampled[i][0] for i in idx]
            b.num_tokens[rows] += 1
        else:
            for i, toks in enumerate(sampled):
                if not toks:
                    continue
                row = plan.rows[i]
                n = b.num_tokens[row]
                b.token_ids[row, n:n + len(toks)] = toks
                b.num_tokens[row] = n + len(toks)
                if plan.drafts[i]:      # the state after the last accepted row is the current one
                    b.cur_slot[row] = plan.spec_dst[i][accepted[i]]
        out = ModelRunnerOutput(req_ids=plan.req_ids, sampled_token_ids=sampled, logprobs=lps,
                                prompt_logprobs=prompt_lps)
        if plan.has_spec:
            lens = np.array([len(d) for d in plan.drafts])
            out.num_draft_tokens = lens.tolist()
            out.num_accepted_tokens = accepted.tolist()
            out.accepted_per_position = [int(np.sum((accepted > j) & (lens > j))) for j in range(int(lens.max()))]
        return out
