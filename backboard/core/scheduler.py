"""The scheduler: no phases. Each request's num_computed_tokens catches up to its num_tokens
(+ drafts) under a token budget per step, so chunked prefill, decode, speculative verification and
resumption after preemption are one path.

Per step: running requests first (those in decode first, so a long prefill never starves them),
then waiting ones while budget, sequence slots, KV blocks and state slots last. When KV blocks run
out, the lowest-priority running request not yet scheduled this step (the latest arrival under
FCFS) is preempted by recompute: its blocks and slots are freed and it goes back to the waiting
queue with its tokens, to be prefilled again later. Fair shares between requests (which waiting
request is admitted, prefill tokens per request per step, preemption victims, paused requests) are
core/fairness.py's policy.

With prefix caching (core/prefix_cache.py), a waiting request starts at the longest cached prefix
it can resume from (num_computed_tokens starts there; the copies that takes ride in the
SchedulerOutput), its prefill chunks end at checkpoint positions, and checkpoints are evicted
before any running request is preempted."""

from __future__ import annotations

import bisect
import itertools
import time

from backboard.config import SchedulerConfig
from backboard.core.fairness import FairShare
from backboard.core.kv_cache_manager import KVCacheManager
from backboard.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from backboard.core.prefix_cache import PrefixCache, PrefixCacheSettings
from backboard.core.state_pool import StatePool, verify_slot_order
from backboard.request import FINISH_REASON, Request, RequestStatus

PEER_WINDOW = 64          # waiting requests looked at for branch points when one is admitted


class WaitingQueue:
    """Requests ordered by (priority, arrival): lower priority value first (vLLM's convention);
    under FCFS the priority is ignored. Preempted requests keep their place."""

    def __init__(self, use_priority: bool) -> None:
        self.use_priority = use_priority
        self._items: list[tuple[int, int, Request]] = []
        self._seq: dict[str, int] = {}
        self._counter = itertools.count()

    def _key(self, r: Request) -> tuple[int, int]:
        if r.request_id not in self._seq:
            self._seq[r.request_id] = next(self._counter)
        return (r.priority if self.use_priority else 0, self._seq[r.request_id])

    def add(self, r: Request) -> None:
        k = self._key(r)
        bisect.insort(self._items, (k[0], k[1], r), key=lambda t: (t[0], t[1]))

    def peek(self) -> Request:
        return self._items[0][2]

    def pop(self) -> Request:
        return self._items.pop(0)[2]

    def remove(self, r: Request) -> bool:
        for i, t in enumerate(self._items):
            if t[2] is r:
                del self._items[i]
                return True
        return False

    def forget(self, r: Request) -> None:
        self._seq.pop(r.request_id, None)

    def order_key(self, r: Request) -> tuple[int, int]:
        return self._key(r)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return (t[2] for t in self._items)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, block_size: int, num_blocks: int,
                 num_state_slots: int | None, num_spec_tokens: int = 0,
                 prefix_cache: PrefixCacheSettings | None = None) -> None:
        self.cfg = cfg
        self.num_spec_tokens = num_spec_tokens
        # with speculation, blocks for k more tokens than scheduled: the proposer writes its own
        # KV cache up to k - 1 positions past the newest token
        self.lookahead = num_spec_tokens
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=prefix_cache is not None)
        self.states = (StatePool(num_state_slots, 1 + num_spec_tokens)
                       if num_state_slots is not None else None)
        self.prefix = PrefixCache(self.kv, self.states, prefix_cache) if prefix_cache is not None else None
        self.waiting = WaitingQueue(cfg.policy == "priority")
        self.fair = FairShare(cfg)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._runner_knows: set[str] = set()
        self._finished_for_runner: set[str] = set()
        self.num_preemptions_total = 0
        self.num_prompt_tokens_total = 0
        self.spec_stats = SchedulerStats()

    # ---- requests in and out --------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.num_prompt_tokens >= self.cfg.max_model_len:
            raise ValueError(f"prompt of {req.num_prompt_tokens} tokens leaves no room in the context "
                             f"of {self.cfg.max_model_len} tokens")
        need = -(-(req.num_prompt_tokens + 1) // self.kv.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"prompt of {req.num_prompt_tokens} tokens needs {need} KV blocks; the "
                             f"cache has {self.kv.pool.num_blocks}")
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def finish_requests(self, req_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        ) -> list[EngineCoreOutput]:
        """Abort (or stop, e.g. on a stop string) requests at any moment; frees everything."""
        outs = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._release(req)
            outs.append(self._output(req, []))
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(len(self.waiting))

    def has_work(self) -> bool:
        """Something to schedule: an unfinished request that is not paused."""
        paused = self.fair.paused
        if not paused:
            return self.has_unfinished_requests()
        return any(r.request_id not in paused for r in itertools.chain(self.running, self.waiting))

    def pause_requests(self, req_ids) -> None:
        """Stop scheduling these (their client is not reading); they keep what they hold."""
        self.fair.pause(rid for rid in req_ids if rid in self.requests)

    def resume_requests(self, req_ids) -> None:
        self.fair.resume(req_ids)

    # ---- schedule ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        now = time.time()
        scheduled: set[str] = set()
        self.fair.begin_step(self.running, self.waiting)
        self.fair.rebalance(self.running, self.waiting, self._can_admit, self._preempt, self._priority_key)
        preemptions_before = self.num_preemptions_total
        if self.prefix is not None:
            self.prefix.clock += 1

        # 1. running requests, those in decode first (a long prefill never starves them)
        running_status = RequestStatus.RUNNING
        for req in sorted(self.running, key=lambda r: r.num_computed_tokens < len(r.all_token_ids) - 1):
            if budget <= 0:
                break
            if req.status != running_status or self.fair.is_paused(req):   # preempted, or paused
                continue
            n = self._num_new_tokens(req, budget)
            if n <= 0:
                continue
            new_blocks = self._allocate_or_preempt(req, n, scheduled)
            if new_blocks is None:
                continue
            self._record(req, n, new_blocks, new_reqs, cached, num_scheduled, spec_tokens)
            scheduled.add(req.request_id)
            budget -= n

        # 2. waiting requests (none after a preemption this step: the pool is tight); one that
        # waits for a running request's checkpoint of their shared prefix is passed over
        waits: set[str] = set()
        while (self.num_preemptions_total == preemptions_before and len(self.waiting) and budget > 0
               and len(self.running) < self.cfg.max_num_seqs):
            req = self.fair.next_waiting(self.waiting, waits)
            if req is None:
                break
            if self.prefix is not None and self.prefix.wait_for_leader(req, self._leaders(num_scheduled)):
                waits.add(req.request_id)
                continue
            admitted = self._admit(req, budget)
            if admitted is None:
                break
            n, new_blocks = admitted
            self.waiting.remove(req)
            self.fair.on_admit(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            self._record(req, n, new_blocks, new_reqs, cached, num_scheduled, spec_tokens)
            budget -= n

        out = SchedulerOutput(
            new_reqs=new_reqs, cached_reqs=cached, num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()), spec_decode_tokens=spec_tokens,
            finished_req_ids=self._finished_for_runner, num_spec_tokens=self.num_spec_tokens)
        if self.prefix is not None:
            out.kv_block_copies, out.state_copies = self.prefix.take_copies()
            out.state_snapshots = self._snapshots(num_scheduled)
        self._finished_for_runner = set()
        return out

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = len(req.all_token_ids) + len(req.spec_token_ids) - req.num_computed_tokens
        if self.cfg.long_prefill_token_threshold > 0:
            n = min(n, self.cfg.long_prefill_token_threshold)
        # never past the context (drafts beyond it are dropped)
        n = min(n, budget, self.cfg.max_model_len - req.num_computed_tokens)
        return self.fair.token_cap(req, n)

    def _snapshots(self, num_scheduled: dict[str, int]) -> dict[str, list[tuple[int, int]]]:
        """Checkpoints the step's prefill chunks take inside themselves (planned once every
        request is scheduled: a leader's promise made this step is kept in this step)."""
        if self.states is None:
            return {}
        planned = ((rid, self.prefix.snapshots(self.requests[rid], n)) for rid, n in num_scheduled.items() if n > 1)
        return {rid: snaps for rid, snaps in planned if snaps}

    def _leaders(self, num_scheduled: dict[str, int]) -> list[tuple[Request, int]]:
        """Running requests a waiting one may wait for (not paused), with the tokens each had
        computed before its chunk of this step."""
        return [(r, r.num_computed_tokens - num_scheduled.get(r.request_id, 0))
                for r in self.running if not self.fair.is_paused(r)]

    def _peers(self, req: Request) -> list[Request]:
        """Waiting requests behind `req` whose shared prefix it should checkpoint (a window)."""
        return [r for r in itertools.islice(self.waiting, PEER_WINDOW) if r is not req]

    def _can_admit(self, req: Request) -> bool:
        """A sequence slot, a state slot and KV blocks for its first chunk are free now."""
        if len(self.running) >= self.cfg.max_num_seqs:
            return False
        if self.states is not None and not self.states.can_allocate():
            return False
        n = min(len(req.all_token_ids) - req.num_computed_tokens, self.cfg.max_num_batched_tokens)
        return self.kv.can_allocate(req, n + self.lookahead)

    def _admit(self, req: Request, budget: int) -> tuple[int, list[int]] | None:
        """Blocks and slots for a waiting request's first chunk: (tokens, new blocks), or None
        (nothing allocated). With prefix caching it resumes where the cache lets it."""
        if self.prefix is not None:
            hit = self.prefix.lookup(req, self._peers(req))
            req.num_computed_tokens = hit.num_tokens
            n = self._num_new_tokens(req, budget)
            new_blocks = self.prefix.allocate(req, hit, n + self.lookahead) if n > 0 else None
            if new_blocks is None:
                req.num_computed_tokens = 0
                return None
            return n, new_blocks
        if self.states is not None and not self.states.can_allocate():
            return None
        n = self._num_new_tokens(req, budget)
        new_blocks = self.kv.allocate(req, n + self.lookahead) if n > 0 else None
        if new_blocks is None:
            return None
        if self.states is not None:
            self.states.allocate(req)
        return n, new_blocks

    def _allocate_or_preempt(self, req: Request, n: int, scheduled: set[str]) -> list[int] | None:
        """Allocate blocks for n new tokens, preempting lower-priority running requests (not yet
        scheduled this step) until it fits. None when req itself had to be preempted."""
        if req.num_computed_tokens + n + self.lookahead <= len(req.block_ids) * self.kv.block_size:
            return []                      # the common decode step: its blocks are there
        while True:
            new_blocks = self.kv.allocate(req, n + self.lookahead)
            if new_blocks is not None:
                return new_blocks
            if self.prefix is not None and self.prefix.make_room_for_blocks(
                    self.kv.num_blocks_needed(req, n + self.lookahead)):
                continue                   # checkpoints went before any request is preempted
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = self.fair.kv_victim(candidates, self._priority_key)
            self._preempt(victim)
            if victim is req:
                return None

    def _priority_key(self, r: Request) -> tuple[int, int]:
        """Larger = lower priority (preempted first)."""
        return self.waiting.order_key(r)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.fair.on_preempt(req)
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add(req)

    def _release(self, req: Request) -> None:
        keep = self.prefix.on_release(req, req.is_finished) if self.prefix is not None else None
        if req.block_ids:
            self.kv.free(req)
        if self.states is not None and req.state_slots:
            self.states.free(req, keep)
        if req.request_id in self._runner_knows:
            self._runner_knows.discard(req.request_id)
            self._finished_for_runner.add(req.request_id)
        if req.is_finished:
            self.requests.pop(req.request_id, None)
            self.waiting.forget(req)
            self.fair.paused.discard(req.request_id)

    def _record(self, req: Request, n: int, new_blocks: list[int], new_reqs: list[NewRequestData],
                cached: CachedRequestData, num_scheduled: dict[str, int],
                spec_tokens: dict[str, list[int]]) -> None:
        rid = req.request_id
        if rid in self._runner_knows:
            cached.req_ids.append(rid)
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(req.num_computed_tokens)
        else:
            self._runner_knows.add(rid)
            new_reqs.append(NewRequestData(
                req_id=rid, token_ids=list(req.all_token_ids), num_prompt_tokens=req.num_prompt_tokens,
                sampling_params=req.sampling_params, eos_token_ids=tuple(req.eos_token_ids),
                block_ids=list(req.block_ids), state_slots=list(req.state_slots),
                num_computed_tokens=req.num_computed_tokens,
                num_prompt_logprobs_emitted=req.num_prompt_logprobs_emitted))
        num_scheduled[rid] = n
        self.fair.charge(req, n)
        num_spec = req.num_computed_tokens + n - len(req.all_token_ids)
        if num_spec > 0:
            spec_tokens[rid] = req.spec_token_ids[:num_spec]
        req.num_computed_tokens += n        # advanced now; rejected drafts are rolled back later

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outs: list[EngineCoreOutput] = []
        now = time.time()
        requests, spec, running = self.requests, so.spec_decode_tokens, RequestStatus.RUNNING
        for i, rid in enumerate(ro.req_ids):
            req = requests.get(rid)
            if req is None or req.status != running:
                continue   # aborted or preempted since it was scheduled
            sampled = ro.sampled_token_ids[i]
            drafts = spec.get(rid) if spec else None
            if drafts and sampled:
                req.num_computed_tokens -= len(drafts) + 1 - len(sampled)   # rejected drafts
            new_tokens: list[int] = []
            for t in sampled:
                new_tokens.append(t)
                if req.append_token(t):
                    break
            if drafts and new_tokens and req.state_slots:
                # the worker's rule (verify_slot_order): the state after the last kept row is current
                req.current_state_slot = verify_slot_order(
                    req.state_slots, req.current_state_slot, len(drafts) + 1)[len(new_tokens) - 1]
            if new_tokens and req.first_token_time is None:
                req.first_token_time = now
                self.num_prompt_tokens_total += req.num_prompt_tokens
            if ro.spec_token_ids is not None and not req.is_finished:
                req.spec_token_ids = ro.spec_token_ids[i]
            else:
                req.spec_token_ids = []
            lps = ro.logprobs[i]
            if lps is not None:
                lps = lps[:len(new_tokens)]
            plp = ro.prompt_logprobs.get(rid) if ro.prompt_logprobs else None
            if plp:
                req.num_prompt_logprobs_emitted += len(plp)
            finished = req.status != running
            if finished:
                self.running.remove(req)
                self._release(req)
            elif self.prefix is not None:
                self.prefix.after_step(req)
            if new_tokens or finished or plp:
                outs.append(self._output(req, new_tokens, lps, plp))
        if ro.num_draft_tokens is not None:
            self._update_spec_stats(ro)
        return outs

    def _update_spec_stats(self, ro: ModelRunnerOutput) -> None:
        s = self.spec_stats
        for nd, na in zip(ro.num_draft_tokens or [], ro.num_accepted_tokens or []):
            if nd:
                s.spec_num_drafts += 1
                s.spec_num_draft_tokens += nd
                s.spec_num_accepted_tokens += na
        per = ro.accepted_per_position or []
        if len(s.spec_accepted_per_position) < len(per):
            s.spec_accepted_per_position += [0] * (len(per) - len(s.spec_accepted_per_position))
        for j, a in enumerate(per):
            s.spec_accepted_per_position[j] += a
        s.spec_draft_time_s += ro.draft_time_s
        s.spec_verify_time_s += ro.verify_time_s

    @staticmethod
    def _output(req: Request, new_tokens: list[int], logprobs=None, prompt_logprobs=None,
                ) -> EngineCoreOutput:
        return EngineCoreOutput(req.request_id, new_tokens, logprobs, prompt_logprobs,
                                FINISH_REASON.get(req.status), req.stop_reason, req.num_prompt_tokens,
                                req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                req.num_preemptions, req.num_cached_tokens)

    # ---- observability -------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        s = self.spec_stats
        kv_usage, slot_usage = self._usage_by_requests()
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=kv_usage, state_slot_usage=slot_usage,
            num_preemptions_total=self.num_preemptions_total,
            spec_num_drafts=s.spec_num_drafts, spec_num_draft_tokens=s.spec_num_draft_tokens,
            spec_num_accepted_tokens=s.spec_num_accepted_tokens,
            spec_accepted_per_position=list(s.spec_accepted_per_position),
            spec_draft_time_s=s.spec_draft_time_s, spec_verify_time_s=s.spec_verify_time_s,
            num_prompt_tokens_total=self.num_prompt_tokens_total, **self._prefix_stats())

    def _usage_by_requests(self) -> tuple[float, float]:
        """(KV blocks, state slots) held by requests, as fractions. What only prefix-cache
        checkpoints or the LRU hold is reclaimable on demand, so it does not count (vLLM's meaning;
        the checkpoints have a gauge of their own)."""
        slots = self.states.usage() if self.states is not None else 0.0
        if self.prefix is None:
            return self.kv.usage(), slots
        blocks = {b for r in self.running for b in r.block_ids}
        if self.states is not None:
            slots = sum(len(r.state_slots) for r in self.running) / self.states.num_slots
        return len(blocks) / self.kv.pool.num_blocks, slots

    def _prefix_stats(self) -> dict[str, int]:
        if self.prefix is None:
            return {}
        p = self.prefix.stats
        return dict(prefix_cache_queries=p.queries, prefix_cache_hits=p.hits,
                    prefix_cache_checkpoints=len(self.prefix.store))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and checkpoint (e.g. between benchmark runs)."""
        if self.prefix is not None:
            self.prefix.reset()

    def check_integrity(self) -> None:
        """Every block and slot is free or held by running requests and checkpoints, as their
        reference counts say."""
        for r in self.waiting:
            if r.block_ids or r.state_slots:
                raise AssertionError(f"waiting request {r.request_id} holds blocks or slots")
        ck_blocks, ck_slots = self.prefix.owners() if self.prefix is not None else ([], [])
        self.kv.check_integrity(self.running, ck_blocks)
        if self.states is not None:
            self.states.check_integrity(self.running, ck_slots)
        if self.prefix is not None:
            self.prefix.check_integrity()
        if len(self.running) > self.cfg.max_num_seqs:
            raise AssertionError("more running requests than max_num_seqs")
