"""The contract between the scheduler and the worker (no tensors): SchedulerOutput in,
ModelRunnerOutput back; and what the engine core hands the front end (EngineCoreOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from backboard.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption)."""

    req_id: str
    token_ids: list[int]                 # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    state_slots: list[int]
    num_computed_tokens: int
    # prompt logprobs already emitted for prompt tokens 1..n (only positions >= n compute them)
    num_prompt_logprobs_emitted: int = 0


@dataclass
class CachedRequestData:
    """Requests the runner already holds: their new blocks and where they stand."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]          # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    spec_decode_tokens: dict[str, list[int]]      # req_id -> drafts verified this step
    finished_req_ids: set[str]                    # finished / aborted / preempted: drop them
    num_spec_tokens: int = 0                      # drafts to propose for the next step (k)
    # prefix caching: copies the worker makes before this step's forward (even in an otherwise
    # empty step), each list in order: (src block, dst block) for the K and V of every attention
    # layer (the proposer's too); (src slot, dst slot) for the conv and recurrent state of every
    # GDN layer
    kv_block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # prefix caching: checkpoints taken inside a prefill chunk, req_id -> [(p, slot)] by p: the GDN
    # state after the request's first p tokens (num_computed < p < num_computed + scheduled) goes
    # to slot too (ForwardMeta.state_snapshots)
    state_snapshots: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class TokenLogprobs(msgspec.Struct, gc=False, array_like=True):
    """Logprobs of one position: the chosen token's and the top-n. Never tracked by the garbage
    collector (no references to anything but numbers; the tuples are untracked by its first young
    pass): a front end holding a large response's logprobs gives its full passes nothing to scan."""

    token_id: int
    logprob: float
    rank: int                                     # 1 = most likely
    top: tuple[tuple[int, float], ...]            # ((token id, logprob), ...) best first


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]            # per request; [] when a prefill chunk ends mid-prompt
    logprobs: list[list[TokenLogprobs] | None]    # per request, per sampled token
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    spec_token_ids: list[list[int]] | None = None  # drafts proposed for the next step
    num_draft_tokens: list[int] | None = None     # drafts verified this step, per request
    num_accepted_tokens: list[int] | None = None  # of which accepted
    accepted_per_position: list[int] | None = None  # over all requests: accepted at draft pos i
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    forward_time_s: float = 0.0                   # model forward + LM head (worker/step_timing.py)


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None              # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    # timestamps (time.time()) for metrics
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0                    # prompt tokens the prefix cache served


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0                   # held by requests (not by prefix-cache checkpoints)
    state_slot_usage: float = 0.0
    num_preemptions_total: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_draft_time_s: float = 0.0
    spec_verify_time_s: float = 0.0
    num_prompt_tokens_total: int = 0              # prompts prefilled (counted at their first token)
    prefix_cache_queries: int = 0                 # tokens of admitted requests looked up
    prefix_cache_hits: int = 0                    # of which served from the prefix cache
    prefix_cache_checkpoints: int = 0             # GDN state checkpoints held now
