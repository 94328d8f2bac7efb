"""Request state on the CPU: token ids, num_computed_tokens, status, KV blocks, state slots.

No tensors here: the scheduler (core/) owns these objects."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from backboard.sampling_params import SamplingParams

FINISH_REASON: dict[int, str] = {}


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASON.get(self)


FINISH_REASON.update({RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                       RequestStatus.FINISHED_ABORTED: "abort"})


@dataclass
class EngineCoreRequest:
    """What the front end sends to the engine core (picklable)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    group: str | None = None        # what fair shares count over (core/fairness.py); None: this request
    prefix_hint: int = 0            # > 0: leading prompt tokens others will share (a chat's system part):
                                    # the prefix cache keeps a state checkpoint where they end


class Request:
    def __init__(self, req: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = req.request_id
        self.sampling_params = req.sampling_params
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.arrival_time = req.arrival_time
        self.priority = req.priority
        self.group = req.group or req.request_id
        self.prefix_hint = req.prefix_hint
        sp = req.sampling_params
        self.eos_token_ids = frozenset(() if sp.ignore_eos else req.eos_token_ids)
        self.stop_token_ids = frozenset(sp.stop_token_ids or ())
        self._stoppers = self.eos_token_ids | self.stop_token_ids
        budget = max_model_len - self.num_prompt_tokens
        self.max_tokens = min(sp.max_tokens, budget) if sp.max_tokens is not None else budget
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # prompt tokens 1..n whose logprobs were emitted: kept across preemption, so recomputed
        # prompt positions emit no second set
        self.num_prompt_logprobs_emitted = 0
        self.spec_token_ids: list[int] = []     # drafts to verify in the next step
        self.block_ids: list[int] = []
        self.state_slots: list[int] = []
        self.current_state_slot = -1            # the slot holding the state after num_computed
        self.block_hashes: list[bytes] = []     # chained hashes of full blocks (prefix caching)
        self.num_preemptions = 0
        # timing (engine clock, time.time()) for metrics
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_cached_tokens = 0              # prompt tokens served by the prefix cache

    # -------------------------------------------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> bool:
        """Append a sampled token; returns True when it finishes the request (status set)."""
        toks = self.all_token_ids
        toks.append(token_id)
        n = len(toks) - self.num_prompt_tokens
        if token_id in self._stoppers and n >= self.sampling_params.min_tokens:
            self.status = RequestStatus.FINISHED_STOPPED
            if token_id not in self.eos_token_ids:
                self.stop_reason = token_id
            return True
        if n >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
