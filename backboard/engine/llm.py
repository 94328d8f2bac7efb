"""The offline API, with the names vLLM users know:

    from backboard import LLM, SamplingParams
    llm = LLM(model=PATH)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from typing import Any, Sequence

from backboard.config import EngineConfig
from backboard.engine.engine_core import EngineCore
from backboard.engine.output_processor import InputProcessor, OutputProcessor, ParentRequest, RequestOutput
from backboard.engine.tokenizer import Tokenizer
from backboard.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, *, tokenizer: str | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory_gib: float | None = None,
                 gpu_memory_utilization: float = 0.9, seed: int = 0,
                 speculative_config: Any = None, device: str = "auto",
                 scheduling_policy: str = "fcfs", long_prefill_token_threshold: int = 0,
                 enforce_eager: bool = False) -> None:
        self.config = EngineConfig.create(
            model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            num_kv_blocks=num_kv_blocks, kv_cache_memory_gib=kv_cache_memory_gib,
            gpu_memory_utilization=gpu_memory_utilization, speculative_config=speculative_config,
            device=device, seed=seed, tokenizer=tokenizer, scheduling_policy=scheduling_policy,
            long_prefill_token_threshold=long_prefill_token_threshold, enforce_eager=enforce_eager)
        self.tokenizer = Tokenizer(tokenizer or model)
        self.engine = EngineCore(self.config)
        mc = self.config.model
        eos = tuple(dict.fromkeys(mc.eos_token_ids + self.tokenizer.eos_token_ids))
        self.inputs = InputProcessor(self.tokenizer, self.config.scheduler.max_model_len,
                                     mc.vocab_size, eos)
        self.outputs = OutputProcessor(self.tokenizer)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # ---------------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        parents = [self._add(p, sp, pr) for p, sp, pr in
                   zip(prompts, params, priority or [0] * len(prompts))]
        self._run(parents, use_tqdm)
        return [p.output() for p in parents]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, **(chat_template_kwargs or {}))
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict[str, Any]:
        """Engine counters, with speculative decoding's acceptance when it is on."""
        s = self.engine.stats()
        d: dict[str, Any] = {"num_steps": self.engine.num_steps, "num_preemptions": s.num_preemptions_total,
                             "generated_tokens": self.engine.num_tokens_generated}
        if self.config.spec is not None:
            drafts = max(s.spec_num_drafts, 1)
            d.update({
                "spec_num_drafts": s.spec_num_drafts,
                "spec_num_draft_tokens": s.spec_num_draft_tokens,
                "spec_num_accepted_tokens": s.spec_num_accepted_tokens,
                "spec_mean_acceptance_length": 1 + s.spec_num_accepted_tokens / drafts,
                "spec_acceptance_rate_per_position": [a / drafts for a in s.spec_accepted_per_position],
                "spec_draft_time_s": s.spec_draft_time_s, "spec_verify_time_s": s.spec_verify_time_s})
        return d

    # ---------------------------------------------------------------------------------------
    def _add(self, prompt, params: SamplingParams, priority: int) -> ParentRequest:
        text, ecr = self.inputs.make_request(prompt, params, priority=priority)
        parent = ParentRequest(ecr.request_id, text, ecr.prompt_token_ids, params, self.tokenizer,
                               ecr.arrival_time)
        for i, cid in enumerate(self.outputs.add(parent)):
            ecr.request_id, ecr.sampling_params = cid, parent.child_params(i)
            self.engine.add_request(_copy(ecr))
        return parent

    def _run(self, parents: list[ParentRequest], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(parents), desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            outs, to_stop = self.outputs.process(self.engine.step())
            if to_stop:
                self.engine.stop_requests(to_stop)
            if bar is not None:
                bar.update(sum(1 for o in outs if o.finished))
        if bar is not None:
            bar.close()


def _copy(ecr):
    from dataclasses import replace

    return replace(ecr, prompt_token_ids=list(ecr.prompt_token_ids))


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]          # one prompt of token ids
    return prompts


def _as_params_list(sp, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
    return sp
