"""The front end's side of a request: prompt validation and tokenization on the way in;
incremental detokenization, stop strings, logprobs and fan-out of n > 1 on the way out.

The same code serves the offline LLM and the HTTP server (engine/async_llm.py)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from backboard.core.outputs import EngineCoreOutput, TokenLogprobs
from backboard.engine.detokenizer import IncrementalDetokenizer
from backboard.engine.tokenizer import Tokenizer
from backboard.request import EngineCoreRequest
from backboard.sampling_params import SamplingParams

Logprobs = dict[int, float]     # token id -> logprob (the chosen / prompt token and the top-n)
SEED_RANGE = 2 ** 63            # seeds are in [0, 2**63) (SamplingParams.validate)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None          # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # streaming: what this update added
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[Logprobs | None] | None = None
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0                # prompt tokens served by the prefix cache


class InputError(ValueError):
    """A request that cannot be served (empty or over-long prompt, bad token ids)."""


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self._ids = itertools.count()

    def prompt_ids(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InputError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("text prompts need a tokenizer; pass token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InputError("a prompt must be a string or a list of token ids")

    def make_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                     priority: int = 0, arrival_time: float | None = None) -> tuple[str | None, EngineCoreRequest]:
        text, ids = self.prompt_ids(prompt)
        if not ids:
            raise InputError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InputError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                             "tokens and at least one must be left for the output")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise InputError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                             f"the context of {self.max_model_len} tokens")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return text, EngineCoreRequest(rid, ids, params, self.eos_token_ids,
                                       arrival_time if arrival_time is not None else time.time(), priority)


class RequestState:
    """One child request (one of n completions) as the front end follows it. With `cumulative`
    False only the deltas (and the token ids) are kept: the server, which sends deltas, holds no
    growing text or logprob history per completion."""

    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer | None,
                 cumulative: bool = True) -> None:
        self.index, self.params, self.cumulative = index, params, cumulative
        self.detok = (IncrementalDetokenizer(tokenizer, params.stop, params.include_stop_str_in_output,
                                             params.skip_special_tokens)
                      if tokenizer is not None and params.detokenize else None)
        keep_lps = params.logprobs is not None and cumulative
        self.out = CompletionOutput(index=index, logprobs=[] if keep_lps else None,
                                    cumulative_logprob=0.0 if keep_lps else None)

    def update(self, eco: EngineCoreOutput) -> bool:
        """Apply an engine output; returns True when a stop string ended the request here."""
        o = self.out
        new = list(eco.new_token_ids)
        o.delta_token_ids, o.delta_text, o.delta_logprobs = new, "", None
        stopped = False
        if self.detok is not None and new:
            o.delta_text = self.detok.update(new)
            if self.detok.stopped_by is not None:
                # tokens after the one completing the stop string are dropped
                n_keep = len(self.detok.token_ids) - len(o.token_ids)
                new = new[:n_keep] if n_keep >= 0 else new
                o.delta_token_ids = new
                o.finish_reason, o.stop_reason = "stop", self.detok.stopped_by
                stopped = True
        o.token_ids.extend(new)
        if eco.new_logprobs:
            lps = eco.new_logprobs[:len(new)]
            o.delta_logprobs = lps
            if o.logprobs is not None:
                for lp in lps:
                    d = {lp.token_id: lp.logprob}
                    d.update({t: v for t, v in lp.top})
                    o.logprobs.append(d)
                    o.cumulative_logprob = (o.cumulative_logprob or 0.0) + lp.logprob
        if eco.finish_reason is not None and not o.finished:
            o.finish_reason, o.stop_reason = eco.finish_reason, eco.stop_reason
        if o.finished and self.detok is not None and not stopped:
            o.delta_text += self.detok.finish()
        if self.detok is not None and self.cumulative:
            o.text = self.detok.text[:self.detok.emitted]
        return stopped


class ParentRequest:
    """A user request: the prompt and its n child completions."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer | None, arrival_time: float, cumulative: bool = True) -> None:
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.children = [RequestState(i, params, tokenizer, cumulative) for i in range(params.n)]
        self.prompt_logprobs: list[Logprobs | None] | None = [None] if params.prompt_logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time)
        self.num_cached_tokens = 0

    def child_id(self, i: int) -> str:
        return self.request_id if len(self.children) == 1 else f"{self.request_id}#{i}"

    def child_params(self, i: int) -> SamplingParams:
        if len(self.children) == 1:
            return self.params
        # child i samples with seed + i, wrapped into the seed's range (seed = 2**63 - 1 is valid)
        seed = None if self.params.seed is None else (self.params.seed + i) % SEED_RANGE
        # the children share the prompt: only child 0 computes its logprobs
        return self.params.clone(n=1, seed=seed, prompt_logprobs=None if i else self.params.prompt_logprobs)

    @property
    def finished(self) -> bool:
        return all(c.out.finished for c in self.children)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, [c.out for c in self.children],
                             self.prompt_logprobs, self.finished, self.metrics, self.num_cached_tokens)


class OutputProcessor:
    """Engine outputs -> RequestOutputs; reports requests a stop string ended (to abort in core)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.child_to_parent: dict[str, tuple[ParentRequest, int]] = {}

    def add(self, parent: ParentRequest) -> list[str]:
        self.parents[parent.request_id] = parent
        ids = []
        for i in range(len(parent.children)):
            cid = parent.child_id(i)
            self.child_to_parent[cid] = (parent, i)
            ids.append(cid)
        return ids

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated RequestOutputs (one per touched parent) and the child ids that a
        stop string finished (the engine core must stop them)."""
        touched: dict[str, ParentRequest] = {}
        to_stop: list[str] = []
        now = time.time()
        for eco in outputs:
            entry = self.child_to_parent.get(eco.req_id)
            if entry is None:
                continue
            parent, i = entry
            child = parent.children[i]
            if child.out.finished:
                continue
            if eco.new_prompt_logprobs and parent.prompt_logprobs is not None and i == 0:
                for lp in eco.new_prompt_logprobs:
                    d = {lp.token_id: lp.logprob}
                    d.update({t: v for t, v in lp.top})
                    parent.prompt_logprobs.append(d)
            if child.update(eco):
                to_stop.append(eco.req_id)
            m = parent.metrics
            m.first_scheduled_time = m.first_scheduled_time or eco.first_scheduled_time
            if eco.new_token_ids:
                m.first_token_time = m.first_token_time or now
                m.last_token_time = now
            m.num_preemptions = max(m.num_preemptions, eco.num_preemptions)
            parent.num_cached_tokens = max(parent.num_cached_tokens, eco.num_cached_tokens)
            if child.out.finished:
                self.child_to_parent.pop(eco.req_id, None)
            touched[parent.request_id] = parent
        result = []
        for parent in touched.values():
            if parent.finished:
                parent.metrics.finished_time = now
                self.parents.pop(parent.request_id, None)
            result.append(parent.output())
        return result, to_stop

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent; returns its unfinished child ids (to abort in the core)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        ids = []
        for i in range(len(parent.children)):
            cid = parent.child_id(i)
            if self.child_to_parent.pop(cid, None) is not None:
                ids.append(cid)
        return ids
