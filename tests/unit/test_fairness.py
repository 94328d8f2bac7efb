"""Fair shares in the scheduler (core/fairness.py), with hand-built runner outputs: a request with
n = 128 cannot hold every slot or the whole prefill budget, a small request behind it starts within
a step or two, paused requests are skipped, and n = 1 traffic is never preempted for fairness.
Each test also runs with `fairness="off"` where that shows the starvation the policy prevents."""

from __future__ import annotations

import pytest

from backboard.config import SchedulerConfig
from backboard.core.scheduler import Scheduler
from backboard.request import EngineCoreRequest, Request, RequestStatus
from backboard.sampling_params import SamplingParams
from tests.unit.test_scheduler import step


def sched(fairness="request", max_num_seqs=8, budget=64, blocks=512, bs=4, slots=None) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                          fairness=fairness)
    return Scheduler(cfg, bs, blocks, slots or max_num_seqs)


def req(rid: str, n_prompt: int, max_tokens: int, group: str | None = None, arrival: float = 0.0) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ecr = EngineCoreRequest(rid, list(range(1, n_prompt + 1)), sp, (0,), arrival_time=arrival, group=group)
    return Request(ecr, max_model_len=4096)


def add_parent(s: Scheduler, name: str, n: int, n_prompt: int, max_tokens: int) -> None:
    """A request with n completions: n engine requests sharing one group."""
    for i in range(n):
        s.add_request(req(f"{name}#{i}", n_prompt, max_tokens, group=name, arrival=float(i)))


def steps_until(s: Scheduler, rid: str, limit: int, finished: bool = False) -> int | None:
    """Steps until `rid` is first scheduled (or has finished); None within `limit` steps."""
    for i in range(1, limit + 1):
        so, outs = step(s)
        if finished and any(o.req_id == rid and o.finish_reason for o in outs):
            return i
        if not finished and rid in so.num_scheduled_tokens:
            return i
    return None


@pytest.mark.parametrize("fairness", ["request", "off"])
def test_small_request_behind_n128_starts_at_once(fairness):
    s = sched(fairness)
    add_parent(s, "big", 128, n_prompt=4, max_tokens=500)
    for _ in range(3):
        step(s)
    assert sum(r.group == "big" for r in s.running) == 8      # alone, it may use every slot
    s.add_request(req("small", 4, max_tokens=4, arrival=1000.0))
    started = steps_until(s, "small", limit=200)
    if fairness == "off":
        assert started is None                               # starved behind 128 x 500 tokens
        return
    assert started == 1
    assert steps_until(s, "small", limit=10, finished=True) is not None
    assert s.num_preemptions_total == 1                      # exactly one slot was taken back
    s.check_integrity()


def test_two_big_requests_split_the_slots_and_stay_put():
    s = sched(max_num_seqs=8)
    add_parent(s, "a", 64, n_prompt=4, max_tokens=300)
    step(s)
    add_parent(s, "b", 64, n_prompt=4, max_tokens=300)
    for _ in range(12):
        step(s)
    held = {g: sum(r.group == g for r in s.running) for g in ("a", "b")}
    assert held == {"a": 4, "b": 4}
    before = s.num_preemptions_total
    for _ in range(20):
        step(s)
    assert s.num_preemptions_total == before                 # at their shares: no churn
    s.check_integrity()


@pytest.mark.parametrize("fairness", ["request", "off"])
def test_prefill_budget_is_shared(fairness):
    """A group prefilling 32 long prompts cannot take the whole budget from a newcomer."""
    s = sched(fairness, max_num_seqs=40, budget=64)
    add_parent(s, "big", 32, n_prompt=400, max_tokens=4)
    step(s)
    s.add_request(req("small", 40, max_tokens=4, arrival=1000.0))
    so, _ = step(s)
    big = sum(n for rid, n in so.num_scheduled_tokens.items() if rid.startswith("big"))
    if fairness == "off":
        assert "small" not in so.num_scheduled_tokens and big == 64
        return
    assert big <= 32 and so.num_scheduled_tokens.get("small") == 32


def test_decode_is_never_capped():
    s = sched(max_num_seqs=16, budget=64)
    add_parent(s, "big", 16, n_prompt=2, max_tokens=100)
    for _ in range(3):
        step(s)                                              # all 16 decoding now
    s.add_request(req("long", 200, max_tokens=4, arrival=1000.0))
    s.add_request(req("long2", 200, max_tokens=4, arrival=1001.0))
    so, _ = step(s)
    assert sum(rid.startswith("big") for rid in so.num_scheduled_tokens) == 16 - s.num_preemptions_total


def test_kv_pressure_preempts_the_biggest_group_not_the_newcomer():
    s = sched(max_num_seqs=8, budget=100, blocks=18, bs=4)
    add_parent(s, "big", 4, n_prompt=8, max_tokens=40)
    step(s)                                                  # 4 x 3 blocks
    s.add_request(req("small", 8, max_tokens=40, arrival=1000.0))
    for _ in range(6):
        step(s)
    assert s.requests["small"].status == RequestStatus.RUNNING
    assert any(r.status == RequestStatus.PREEMPTED for r in s.waiting if r.group == "big")
    s.check_integrity()


def test_paused_requests_are_skipped_and_preempted_first():
    s = sched(max_num_seqs=2, budget=100)
    s.add_request(req("a", 4, max_tokens=50, group="g", arrival=1.0))
    s.add_request(req("b", 4, max_tokens=50, group="g", arrival=2.0))
    step(s)
    s.pause_requests(["a", "b", "unknown"])
    assert not s.has_work() and s.has_unfinished_requests()
    so, _ = step(s)
    assert so.num_scheduled_tokens == {}
    s.add_request(req("c", 4, max_tokens=5, arrival=3.0))
    so, _ = step(s)
    assert "c" in so.num_scheduled_tokens                    # a paused request gave way
    assert s.requests["b"].status == RequestStatus.PREEMPTED or s.requests["a"].status == RequestStatus.PREEMPTED
    s.resume_requests(["a", "b"])
    for _ in range(80):
        step(s)
    assert not s.has_unfinished_requests()
    s.check_integrity()


def test_single_completion_requests_are_never_preempted_for_fairness():
    """InferenceX traffic (n = 1, more requests than slots): plain FCFS, no churn."""
    s = sched(max_num_seqs=4, budget=64)
    for i in range(20):
        s.add_request(req(f"r{i}", 6, max_tokens=8, arrival=float(i)))
    order = []
    while s.has_unfinished_requests():
        so, _ = step(s)
        order += [rid for rid in so.num_scheduled_tokens if rid not in order]
    assert s.num_preemptions_total == 0
    assert order == [f"r{i}" for i in range(20)]
