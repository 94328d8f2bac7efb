"""Fair shares of the engine: one request (or one client) cannot hold every sequence slot or the
whole prefill budget, and a small request that arrives behind a huge one starts within a step or
two. The scheduler (core/scheduler.py) asks this policy which waiting request to admit, how many
prompt tokens a request may compute this step, whom to preempt, and which requests are paused.

A *group* is what shares are counted over: a parent request (its n completions are separate
engine requests that share one group), or with `--fairness user` the OpenAI `user` field (when a
request carries one). The policy, with G groups running or waiting:

1. Sequence slots. A group's share is max(1, max_num_seqs // G). Waiting requests are admitted in
   queue order (FCFS, or by priority), except that a group at or over its share is passed over
   while a group under its share waits. When the first such waiting request cannot be admitted (no
   free sequence slot, state slot or KV blocks for its first chunk), running requests of the group
   furthest over its share are preempted before the step (a paused one first, then its latest
   arrival) until it fits: recompute preemption, as under KV pressure. Nobody is preempted for a
   group that already holds its share, so requests with n = 1 are never preempted for fairness.
2. Prefill budget. While two or more groups have prompt tokens to compute, one group's prefill
   chunks take at most max_prefill_share of max_num_batched_tokens per step. Decode (and
   speculative verification) tokens are never capped.
3. KV pressure. When blocks run out mid-step the victim is, among requests not yet scheduled this
   step: a paused request first, then the lowest priority (under `--scheduling-policy priority`),
   then the request of the group holding the most slots, then the latest arrival.
4. Paused requests (the front end pauses a request whose client is not reading its stream) are
   neither scheduled nor admitted until resumed; they keep their blocks unless preempted.

`--fairness off` keeps only 4 (and plain FCFS / priority for the rest). Caps on `n` and on
n x max_tokens per request are the server's (server/limits.py)."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

from backboard.config import SchedulerConfig
from backboard.request import Request


def in_prefill(req: Request) -> bool:
    """More than the newest token left to compute: prompt (or recompute) tokens."""
    return len(req.all_token_ids) - req.num_computed_tokens > 1


class FairShare:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.enabled = cfg.fairness != "off"
        self.max_num_seqs = cfg.max_num_seqs
        self.prefill_cap = max(1, int(cfg.max_num_batched_tokens * cfg.max_prefill_share))
        self.paused: set[str] = set()
        self.held: Counter[str] = Counter()        # group -> running requests, kept up to date in a step
        self.share = cfg.max_num_seqs
        self.contended = False                     # two or more groups have prefill work this step
        self._prefill_used: Counter[str] = Counter()

    # ---- pausing (the front end's backpressure) ------------------------------------------
    def pause(self, req_ids: Iterable[str]) -> None:
        self.paused.update(req_ids)

    def resume(self, req_ids: Iterable[str]) -> None:
        self.paused.difference_update(req_ids)

    def is_paused(self, req: Request) -> bool:
        return req.request_id in self.paused

    # ---- per step --------------------------------------------------------------------------
    def begin_step(self, running: list[Request], waiting: Iterable[Request]) -> None:
        self.held = Counter(r.group for r in running)
        self._prefill_used = Counter()
        if not self.enabled:
            return
        waiting_groups = {r.group for r in waiting if r.request_id not in self.paused}
        self.share = max(1, self.max_num_seqs // max(1, len(set(self.held) | waiting_groups)))
        prefilling = {r.group for r in running if in_prefill(r) and r.request_id not in self.paused}
        self.contended = len(prefilling | waiting_groups) > 1

    def on_admit(self, req: Request) -> None:
        self.held[req.group] += 1

    def on_preempt(self, req: Request) -> None:
        self.held[req.group] -= 1

    def token_cap(self, req: Request, n: int) -> int:
        """Tokens `req` may compute this step out of the n it could."""
        if not self.contended or not in_prefill(req):
            return n
        return max(0, min(n, self.prefill_cap - self._prefill_used[req.group]))

    def charge(self, req: Request, n: int) -> None:
        if self.contended and in_prefill(req):
            self._prefill_used[req.group] += n

    # ---- whom to admit, whom to preempt ----------------------------------------------------
    def next_waiting(self, waiting: Iterable[Request], skip: set[str] = frozenset()) -> Request | None:
        """The waiting request to admit next: the first (in queue order) of a group under its
        share with prefill budget left; else the first one not paused (nor in `skip`)."""
        first = None
        for r in waiting:
            if r.request_id in self.paused or r.request_id in skip \
                    or (self.enabled and self.token_cap(r, 1) == 0):
                continue
            if not self.enabled or self.held[r.group] < self.share:
                return r
            first = first or r
        return first

    def rebalance(self, running: list[Request], waiting: Iterable[Request],
                  can_admit: Callable[[Request], bool], preempt: Callable[[Request], None],
                  order_key: Callable[[Request], tuple]) -> None:
        """Before a step: preempt over-share requests until the first under-share waiting
        request can be admitted (see the module's policy, 1)."""
        if not self.enabled:
            return
        needy = next((r for r in waiting if r.request_id not in self.paused
                      and self.held[r.group] < self.share), None)
        if needy is None:
            return
        while not can_admit(needy):
            over = [r for r in running if self.held[r.group] > self.share
                    and order_key(r)[0] >= order_key(needy)[0]]    # never a higher priority
            if not over:
                return
            preempt(max(over, key=lambda r: (r.request_id in self.paused, self.held[r.group], order_key(r))))

    def kv_victim(self, candidates: list[Request], order_key: Callable[[Request], tuple]) -> Request:
        """Whom to preempt when KV blocks run out (see the module's policy, 3)."""
        def key(r: Request) -> tuple:
            prio, seq = order_key(r)
            return (r.request_id in self.paused, prio, self.held[r.group] if self.enabled else 0, seq)

        return max(candidates, key=key)
