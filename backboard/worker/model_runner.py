"""The model runner: SchedulerOutput -> flat batch -> forward -> sampler -> ModelRunnerOutput.

Each step reads as its phases: prepare (worker/step.py builds the StepPlan), forward (eager or a
CUDA graph, worker/cuda_graph.py), sample (sample/: metadata, sampler, rejection sampling), commit
(the new tokens into the InputBatch, verify slots via spec_decode/verify.py); then the proposer
(spec_decode/) drafts for the next step. GDN state slots: the metadata here, the math in layers/.

Under tensor parallelism every rank runs this runner over its shard (distributed/): rank 0 (the
engine process) broadcasts the step's SchedulerOutput once, every rank prepares and runs the same
forward (the layers all-reduce / gather), rank 0 samples and broadcasts the tokens, and every rank
commits them; the caches hold this rank's heads only."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from backboard.config import EngineConfig
from backboard.constants import spec_token_margin
from backboard.core.outputs import ModelRunnerOutput, SchedulerOutput
from backboard.distributed.parallel_state import all_min, broadcast_object, tp_rank, tp_size
from backboard.distributed.shard import local_model_config
from backboard.forward_context import set_forward_context
from backboard.layers.linear import bf16_linear_weights
from backboard.models.loader import load_model, torch_dtype
from backboard.ops import dispatch
from backboard.ops.token_bitmask import apply_token_bitmask
from backboard.sample.grammar_mask import GrammarBatch, accept_step_tokens, cut_drafts, fill_step_bitmask
from backboard.sample.greedy_screen import screened_argmax
from backboard.sample.metadata import SamplingParamsTable, SpecDecodeMetadata, build_sampling_metadata
from backboard.sample.rejection import verify_drafts
from backboard.sample.sampler import Sampler, compute_logprobs, sampled_logprobs
from backboard.spec_decode.proposer import Proposer, ProposerContext
from backboard.spec_decode.verify import acceptance_counts, commit_accepted_slots
from backboard.worker.cache_ops import apply_cache_copies
from backboard.worker.input_batch import InputBatch, StepInputs
from backboard.worker.memory import allocate_caches, plan_cache, profile_activation_bytes
from backboard.worker.step import SampleResult, StepPlan, prepare_step
from backboard.worker.step_timing import ForwardTimer

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, proposer: Proposer | None = None) -> None:
        self.cfg = cfg
        mc, sc, k = cfg.model, cfg.scheduler, cfg.num_spec_tokens
        self.device = torch.device(cfg.device)
        self.dtype = torch_dtype(mc.dtype)
        t0 = time.time()
        self.model = load_model(mc, str(self.device))
        self.load_time_s = time.time() - t0
        dispatch.prepare_cpu_kernels(self.device, self.dtype)   # build / load them now, not in a step
        self.block_size = cfg.cache.block_size
        # CUDA graphs are not captured under TP yet (the collectives would have to be captured too)
        use_graphs = (self.device.type == "cuda" and not cfg.enforce_eager and mc.num_experts == 0
                      and tp_size() == 1)
        self._allocate_caches(proposer, use_graphs)
        # after the caches: the packed weight copies take only what memory they leave
        lm_head = getattr(getattr(self.model, "lm_head", None), "weight", None)
        dispatch.warm_cpu_gemm(self.device, bf16_linear_weights(self.model), sc.max_num_batched_tokens, lm_head)
        # greedy decoding's INT8 screen of the LM head (sample/greedy_screen.py), under one rank only
        self.screen = dispatch.build_argmax_screen(self.device, lm_head) if tp_size() == 1 else None
        self.screen_rows = dispatch.argmax_screen_rows_max(self.device) if self.screen is not None else 0
        # verify rows and the proposer's lookahead KV writes (constants.spec_token_margin)
        max_blocks = -(-(sc.max_model_len + spec_token_margin(k)) // self.block_size)
        self.batch = InputBatch(sc.max_num_seqs, sc.max_model_len + k, max_blocks, 1 + k)
        self.params = SamplingParamsTable(sc.max_num_seqs)
        self.sampler = Sampler(cfg.seed, self.device)
        self.vocab_size = mc.vocab_size
        self.grammars: GrammarBatch | None = None     # the engine core's, when it constrains requests
        self.proposer: Proposer | None = None
        if proposer is not None:
            self.use_proposer(proposer)
        self.graphs = self._capture_graphs(max_blocks) if use_graphs else None
        self.forward_timer = ForwardTimer(self.device)

    def _allocate_caches(self, proposer: Proposer | None, use_graphs: bool) -> None:
        """Size the KV cache and the state slots (from a profiling pass on CUDA) and allocate them,
        with the proposer's attention layers (this rank's KV heads, or as many as it asks for)."""
        cfg = replace(self.cfg, model=local_model_config(self.cfg.model, tp_size()))   # this rank's heads
        extra_attn_layers = proposer.num_extra_attn_layers if proposer is not None else 0
        extra_kv_heads = proposer.extra_attn_kv_heads if proposer is not None else None
        act = None
        if self.device.type == "cuda" and cfg.cache.num_kv_blocks is None:
            try:
                act = profile_activation_bytes(self.model, cfg, self.dtype, self.device)
            except Exception as e:  # noqa: BLE001 - fall back to the estimate, say so
                logger.warning("profiling pass failed (%s: %s); sizing the cache from an estimate",
                               type(e).__name__, e)
        self.num_blocks, self.num_slots = plan_cache(cfg, self.dtype, self.device, extra_attn_layers, act,
                                                     extra_kv_heads)
        self.num_blocks = all_min(self.num_blocks)     # what every rank holds
        # with graphs, one more block (never handed out) takes the padding rows' KV writes
        self.caches = allocate_caches(cfg.model, self.num_blocks + int(use_graphs), self.block_size,
                                      self.num_slots, self.dtype, self.device, extra_attn_layers, extra_kv_heads)

    def use_proposer(self, proposer: Proposer) -> None:
        """Drafts for the next step come from `proposer` (its extra attention layers must have
        been planned into the caches)."""
        m = self.model
        proposer.bind(ProposerContext(
            batch=self.batch, max_tokens=self.params.a["max_tokens"], caches=self.caches, embed=m.embed_tokens,
            compute_logits=m.compute_logits, lm_head_weight=m.lm_head.weight, block_size=self.block_size,
            device=self.device, dtype=self.dtype))
        self.proposer = proposer

    def _capture_graphs(self, max_blocks: int):
        from backboard.worker.cuda_graph import CudaGraphRunner

        sc, k = self.cfg.scheduler, self.cfg.num_spec_tokens
        graphs = CudaGraphRunner(
            self.model, self.caches, Ls=[1] + ([1 + k] if k else []), max_rows=256,
            max_reqs=sc.max_num_seqs, max_blocks=max_blocks, max_seq_len=sc.max_model_len + spec_token_margin(k),
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
        """(prefix-cache copies ->) prepare -> forward -> sample -> commit (-> propose the next
        step's drafts). Under TP rank 0 broadcasts `so` first (the other ranks receive it in
        worker/tp_worker.py). Kernel choices are read from the environment once for the step
        (dispatch.fixed_selection: the LM head, sampling and the proposer's forwards too)."""
        with dispatch.fixed_selection():
            return self._execute(so)

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if tp_rank() == 0 and tp_size() > 1:
            broadcast_object(so)
        if so.kv_block_copies or so.state_copies:       # prefix caching: before anything is written
            apply_cache_copies(self.caches, so.kv_block_copies, so.state_copies)
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput([], [], [])
        plan = self._prepare(so)
        t0 = time.perf_counter()
        self.forward_timer.start()             # stopped once the logits are computed (_logits)
        hidden = self._forward(plan.inputs)
        grammars = self.grammars.of(plan.req_ids) if self.grammars is not None else None
        result = self._sample(plan, hidden, grammars)
        if grammars is not None:
            accept_step_tokens(grammars, result.token_ids)
        self.forward_timer.stop()              # a step without logit rows ends here
        prompt_lps = self._prompt_logprobs(plan, hidden)
        out = self._commit(plan, result, prompt_lps)
        step_s = time.perf_counter() - t0
        out.verify_time_s = step_s if plan.has_spec else 0.0
        out.forward_time_s = self.forward_timer.collect()
        if self.proposer is not None:
            t1 = time.perf_counter()
            out.spec_token_ids = self.proposer.propose(plan, hidden, result, so.num_spec_tokens, step_s)
            if grammars is not None:
                out.spec_token_ids = cut_drafts(grammars, out.spec_token_ids)
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
            if self.grammars is not None:
                self.grammars.remove(rid)
        for nr in so.new_reqs:
            row = b.add(nr.req_id, nr.token_ids, nr.num_prompt_tokens, nr.block_ids, nr.state_slots,
                        nr.num_prompt_logprobs_emitted)
            self.params.set(row, nr.sampling_params, nr.eos_token_ids)
            if nr.sampling_params.structured_outputs is not None and self.grammars is not None:
                self.grammars.add(nr.req_id, nr.sampling_params.structured_outputs,
                                  nr.token_ids[nr.num_prompt_tokens:])
        cr = so.cached_reqs
        for rid, blocks in zip(cr.req_ids, cr.new_block_ids):
            if blocks:
                b.append_blocks(b.row_of[rid], blocks)

    def _prepare(self, so: SchedulerOutput) -> StepPlan:
        return prepare_step(so, self.batch, self.block_size, self.device)

    def _logits(self, plan: StepPlan, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> fp32 logits [R, V] of the plan's logit rows."""
        logits = self.model.compute_logits(self._logit_hidden(plan, hidden))
        self.forward_timer.stop()
        return logits

    def _logit_hidden(self, plan: StepPlan, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> the plan's logit rows [R, H] (a decode step needs every row: no gather)."""
        rows = plan.logit_rows
        return hidden if len(rows) == hidden.shape[0] else hidden[torch.from_numpy(rows).to(self.device)]

    def _sample(self, plan: StepPlan, hidden: torch.Tensor, grammars=None) -> SampleResult:
        """Tokens for every sampling request (verifying drafts where there are any, masked by
        their grammars where they have one) and their logprobs when asked for. Under TP rank 0
        samples and every rank takes its result."""
        if len(plan.logit_rows) == 0:
            return SampleResult.empty(len(plan.rows))
        if grammars is None and self._screens(plan):
            return self._screened(plan, hidden)
        logits = self._logits(plan, hidden)
        if tp_rank() > 0:
            return broadcast_object()
        return broadcast_object(self._choose(plan, logits, grammars))

    def _plain_greedy(self, plan: StepPlan) -> bool:
        """No drafts to verify and every request greedy without penalties, min_tokens or logprobs."""
        return not plan.has_spec and bool(self.params.plain_greedy[plan.rows[plan.sample_mask]].all())

    def _screens(self, plan: StepPlan) -> bool:
        """Whether this step's tokens come from the LM head's INT8 screen (few plain greedy rows)."""
        return self.screen is not None and len(plan.logit_rows) <= self.screen_rows and self._plain_greedy(plan)

    def _screened(self, plan: StepPlan, hidden: torch.Tensor) -> SampleResult:
        """The argmax of the logit rows' exact logits without computing them all (sample/greedy_screen.py)."""
        tokens = screened_argmax(self._logit_hidden(plan, hidden), self.model.lm_head.weight, self.screen)
        self.forward_timer.stop()
        return self._greedy_result(plan, tokens)

    def _greedy_result(self, plan: StepPlan, tokens: torch.Tensor) -> SampleResult:
        """One token per sampling request: tokens [R] in the order of the plan's logit rows."""
        result = SampleResult.empty(len(plan.rows))
        for i, t in zip(np.nonzero(plan.sample_mask)[0].tolist(), tokens.tolist()):
            result.token_ids[i] = [t]
        return result

    def _choose(self, plan: StepPlan, logits: torch.Tensor, grammars) -> SampleResult:
        """logits [R, V] -> the step's tokens (and logprobs)."""
        if grammars is not None:
            self._apply_grammars(plan, grammars, logits)
        if self._plain_greedy(plan):            # the common case needs nothing but an argmax per request
            return self._greedy_result(plan, dispatch.argmax(logits))
        result = SampleResult.empty(len(plan.rows))
        req_of, choose_pos = plan.logit_row_index()
        md = build_sampling_metadata(self.params, plan.rows[req_of], choose_pos, self.batch, self.vocab_size,
                                     self.device)
        if plan.has_spec:
            spec = SpecDecodeMetadata(plan.drafts, plan.logit_start, req_of)
            tokens, result.num_accepted = verify_drafts(logits, md, spec, self.sampler)
        else:
            ids = self.sampler(logits, md).tolist()
            tokens = {int(req_of[j]): [ids[j]] for j in range(len(ids))}
        for i, toks in tokens.items():
            result.token_ids[i] = toks
        if any(n >= 0 for n in md.num_logprobs):
            for i, lps in sampled_logprobs(logits, tokens, plan.logit_start, md.num_logprobs).items():
                result.logprobs[i] = lps
        return result

    def _apply_grammars(self, plan: StepPlan, grammars, logits: torch.Tensor) -> None:
        """Mask every constrained logit row (draft rows by the state after the drafts before them)."""
        bitmask, rows = fill_step_bitmask(grammars, plan.drafts, plan.logit_start, plan.num_logits, self.vocab_size)
        apply_token_bitmask(logits, bitmask, rows)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> dict[str, list]:
        """For requests with prompt_logprobs: logprobs of the prompt tokens this step's positions
        predict, each prompt position once (positions emitted before a preemption are skipped)."""
        b, a = self.batch, self.params.a
        out: dict[str, list] = {}
        if plan.inputs.meta.prefill_start == len(plan.rows) and not plan.has_spec and plan.sample_mask.all():
            return out                            # a decode-only step has no prompt rows
        want = np.nonzero(a["prompt_logprobs"][plan.rows] >= 0)[0]
        qsl = plan.inputs.query_start_loc
        for i in want:
            row, nc, q = plan.rows[i], plan.num_computed[i], plan.q_lens[i]
            first = max(nc, int(b.prompt_logprobs_from[row]))
            last = min(nc + q, int(b.num_prompt[row]) - 1)   # positions first .. last-1 predict prompt tokens
            if last <= first:
                continue
            h = hidden[qsl[i] + (first - nc):qsl[i] + (last - nc)]
            nxt = torch.from_numpy(b.token_ids[row, first + 1:last + 1]).to(self.device)
            n = int(a["prompt_logprobs"][row])
            out[plan.req_ids[i]] = compute_logprobs(self.model.compute_logits(h), nxt, [n] * len(nxt))
        return out

    def _commit(self, plan: StepPlan, result: SampleResult, prompt_lps: dict[str, list]) -> ModelRunnerOutput:
        """Write the new tokens into the batch; move GDN state pointers past accepted drafts."""
        b, sampled = self.batch, result.token_ids
        if not plan.has_spec:                     # one token per sampling request
            idx = np.nonzero(plan.sample_mask)[0]
            rows = plan.rows[idx]
            b.token_ids[rows, b.num_tokens[rows]] = [sampled[i][0] for i in idx]
            b.num_tokens[rows] += 1
        else:
            for i, toks in enumerate(sampled):
                row, n = plan.rows[i], b.num_tokens[plan.rows[i]]
                b.token_ids[row, n:n + len(toks)] = toks
                b.num_tokens[row] = n + len(toks)
            commit_accepted_slots(b, plan.rows, plan.verify_dst_slots, result.num_accepted, sampled)
        out = ModelRunnerOutput(req_ids=plan.req_ids, sampled_token_ids=sampled, logprobs=result.logprobs,
                                prompt_logprobs=prompt_lps)
        if plan.has_spec:
            out.num_draft_tokens, out.num_accepted_tokens, out.accepted_per_position = acceptance_counts(
                plan.drafts, result.num_accepted)
        return out
