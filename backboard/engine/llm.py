"""The offline API, with the names vLLM users know:

    from backboard import LLM, SamplingParams
    llm = LLM(model=PATH)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from backboard.config import ConfigError, EngineConfig
from backboard.engine.cpu_threads import set_engine_threads
from backboard.engine.engine_core import EngineCore
from backboard.engine.output_processor import InputProcessor, OutputProcessor, ParentRequest, RequestOutput
from backboard.engine.tokenizer import Tokenizer
from backboard.models.gguf import resolve_model_path
from backboard.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **settings: Any) -> None:
        """`model`: a checkpoint folder or a GGUF file; `settings`: the engine settings (the fields of
        backboard.config.EngineArgs: max_num_seqs, max_model_len, dtype, speculative_config, ...)."""
        model = resolve_model_path(model)         # a GGUF file: its converted folder
        self.config = EngineConfig.create(model, **settings)
        if self.config.parallel.data_parallel_size > 1:
            raise ConfigError("the offline LLM runs one engine: data_parallel_size > 1 is for `backboard serve` "
                              "(tensor_parallel_size works here)")
        set_engine_threads(self.config)           # in-process: this process computes the steps
        self.tokenizer = Tokenizer(self.config.tokenizer or model)
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
        ids = [self.add_request(p, sp, priority=pr) for p, sp, pr in
               zip(prompts, params, priority or [0] * len(prompts))]
        done = self._run_to_completion(use_tqdm, len(ids))
        return [done[i] for i in ids]

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
        if self.config.cache.enable_prefix_caching:
            d.update({"prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
                      "prefix_cache_hit_rate": s.prefix_cache_hits / max(s.prefix_cache_queries, 1),
                      "prefix_cache_checkpoints": s.prefix_cache_checkpoints})
        return d

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (a no-op with TP = 1)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (KV blocks and state checkpoints)."""
        self.engine.reset_prefix_cache()

    # ---- step by step (vLLM's LLMEngine names) ------------------------------------------------
    def add_request(self, prompt: str | Sequence[int] | dict[str, Any], params: SamplingParams | None = None,
                    *, request_id: str | None = None, priority: int = 0) -> str:
        """Validate (InputError), tokenize and queue a request; returns its id. `step()` runs it."""
        params = params if params is not None else SamplingParams()
        if request_id is not None and request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ecr = self.inputs.make_request(prompt, params, request_id=request_id, priority=priority)
        parent = ParentRequest(ecr.request_id, text, ecr.prompt_token_ids, params, self.tokenizer,
                               ecr.arrival_time)
        for i, cid in enumerate(self.outputs.add(parent)):
            self.engine.add_request(replace(ecr, request_id=cid, sampling_params=parent.child_params(i),
                                            prompt_token_ids=list(ecr.prompt_token_ids)))
        return ecr.request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; the RequestOutput of every request it advanced (`finished` once all of
        its completions are done; each CompletionOutput's delta_* fields say what this step added)."""
        if not self.engine.has_unfinished_requests():
            return []
        outs, to_stop = self.outputs.process(self.engine.step())
        if to_stop:
            self.engine.stop_requests(to_stop)      # a stop string ended them in the front end
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Forget requests and free what they hold in the engine."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.engine.abort_requests(self.outputs.abort(rid))

    def _run_to_completion(self, use_tqdm: bool, total: int) -> dict[str, RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="generate", unit="req")
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            finished = [o for o in self.step() if o.finished]
            done.update((o.request_id, o) for o in finished)
            if bar is not None:
                bar.update(len(finished))
        if bar is not None:
            bar.close()
        return done


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
