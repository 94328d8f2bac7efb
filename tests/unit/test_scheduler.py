"""The scheduler with hand-built runner outputs: no model, no tensors."""

from __future__ import annotations

import random

import pytest

from backboard.config import SchedulerConfig
from backboard.core.outputs import ModelRunnerOutput, SchedulerOutput
from backboard.core.scheduler import Scheduler
from backboard.request import EngineCoreRequest, Request, RequestStatus
from backboard.sampling_params import SamplingParams


def make_sched(max_num_seqs=8, budget=64, blocks=64, bs=4, slots=8, max_len=256, k=0, policy="fcfs"):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_len, policy=policy)
    return Scheduler(cfg, bs, blocks, slots, num_spec_tokens=k)


def req(rid, n_prompt, max_tokens=4, priority=0, arrival=None):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    r = EngineCoreRequest(rid, list(range(1, n_prompt + 1)), sp, (0,), priority=priority)
    if arrival is not None:
        r.arrival_time = arrival
    return Request(r, max_model_len=256)


def fake_run(so: SchedulerOutput, sched: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """A runner that samples `token` for every request whose step reaches its last token."""
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        r = sched.requests[rid]
        ids.append(rid)
        # num_computed was advanced by schedule(): the step reached the end iff it now covers
        # every known token
        sampled.append([token] if r.num_computed_tokens >= r.num_tokens else [])
    return ModelRunnerOutput(ids, sampled, [None] * len(ids))


def step(sched):
    so = sched.schedule()
    outs = sched.update_from_output(so, fake_run(so, sched))
    return so, outs


def test_budget_respected_and_prefill_chunked():
    s = make_sched(budget=10)
    s.add_request(req("a", 25))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 10}
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 10}
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 5}
    assert outs and outs[0].new_token_ids == [7]          # sampled only when the prompt is done


def test_decodes_never_starved_by_long_prefill():
    s = make_sched(budget=16, blocks=256)
    s.add_request(req("d1", 3, max_tokens=50))
    s.add_request(req("d2", 3, max_tokens=50))
    step(s)                                                 # both prefilled
    s.add_request(req("long", 200, max_tokens=2))
    for _ in range(10):
        so, outs = step(s)
        # every step both decodes run, the long prompt takes what is left of the budget
        assert so.num_scheduled_tokens["d1"] == 1 and so.num_scheduled_tokens["d2"] == 1
        assert so.total_num_scheduled_tokens <= 16
        assert so.num_scheduled_tokens.get("long", 0) == 14
        assert {o.req_id for o in outs} >= {"d1", "d2"}


def test_decode_scheduled_before_an_earlier_prefill():
    """A request admitted earlier but still prefilling does not take budget before a decode;
    long_prefill_token_threshold caps a prefill's share of a step."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=7, max_model_len=256,
                          long_prefill_token_threshold=5)
    s = Scheduler(cfg, 4, 256, 8)
    s.add_request(req("p", 40))
    s.add_request(req("q", 2, max_tokens=30))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"p": 5, "q": 2}
    for _ in range(4):
        so, _ = step(s)
        assert list(so.num_scheduled_tokens) == ["q", "p"]     # the decode first
        assert so.num_scheduled_tokens == {"q": 1, "p": 5}


def test_max_num_seqs():
    s = make_sched(max_num_seqs=2, budget=100, blocks=256)
    for i in range(4):
        s.add_request(req(f"r{i}", 5))
    so, _ = step(s)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"} and len(s.waiting) == 2


def test_preemption_order_is_latest_arrival_first_and_resume():
    s = make_sched(budget=100, blocks=6, bs=4, max_num_seqs=4)   # 24 tokens of KV
    for i, t in enumerate((1.0, 2.0, 3.0)):
        s.add_request(req(f"r{i}", 8, max_tokens=20, arrival=t))
    step(s)                                                  # 3 x 2 blocks = 6 blocks
    assert len(s.running) == 3
    so, _ = step(s)                                          # decodes need a 3rd block each
    pre = [r.request_id for r in s.waiting]
    assert pre and pre[0] == "r2"                            # the latest arrival goes first
    assert s.requests["r2"].status == RequestStatus.PREEMPTED
    assert s.requests["r2"].num_computed_tokens == 0 and not s.requests["r2"].block_ids
    assert "r2" in so.finished_req_ids                       # the runner drops it this step
    s.check_integrity()


def test_priority_policy_preempts_lowest_priority():
    s = make_sched(budget=100, blocks=6, bs=4, policy="priority")
    s.add_request(req("low", 8, max_tokens=20, priority=5, arrival=1.0))
    s.add_request(req("high", 8, max_tokens=20, priority=0, arrival=2.0))
    s.add_request(req("mid", 8, max_tokens=20, priority=2, arrival=3.0))
    step(s)
    step(s)
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    assert s.requests["high"].status == RequestStatus.RUNNING


def test_priority_orders_waiting():
    s = make_sched(max_num_seqs=1, budget=100, policy="priority")
    s.add_request(req("b", 3, priority=3))
    s.add_request(req("a", 3, priority=1))
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["a"]


def test_abort_frees_everything_at_any_moment():
    s = make_sched(budget=6, blocks=64)
    s.add_request(req("a", 20))
    s.add_request(req("b", 3))
    step(s)                                                  # a is mid-prefill
    outs = s.finish_requests(["a", "b", "nope"])
    assert {o.req_id for o in outs} == {"a", "b"} and all(o.finish_reason == "abort" for o in outs)
    assert s.kv.pool.num_free == 64 and s.states.num_free == 8
    assert not s.has_unfinished_requests()
    s.check_integrity()


def test_finish_on_max_tokens_and_eos():
    s = make_sched()
    s.add_request(req("a", 3, max_tokens=2))
    _, o1 = step(s)
    _, o2 = step(s)
    assert o2[0].finish_reason == "length" and not s.has_unfinished_requests()
    r = EngineCoreRequest("e", [1, 2, 3], SamplingParams(max_tokens=10), (7,))
    s.add_request(Request(r, 256))
    _, o = step(s)
    assert o[0].finish_reason == "stop"                      # fake runner samples 7 = eos
    assert s.kv.pool.num_free == 64


def test_min_tokens_suppresses_stop():
    s = make_sched()
    r = EngineCoreRequest("e", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=3), (7,))
    s.add_request(Request(r, 256))
    for _ in range(2):
        _, o = step(s)
        assert o[0].finish_reason is None
    _, o = step(s)
    assert o[0].finish_reason == "stop"


def test_spec_tokens_scheduled_and_rejections_roll_back():
    s = make_sched(k=2, slots=8)
    s.add_request(req("a", 3, max_tokens=10))
    so = s.schedule()
    ro = ModelRunnerOutput(["a"], [[5]], [None], spec_token_ids=[[8, 9]])
    s.update_from_output(so, ro)
    r = s.requests["a"]
    assert r.spec_token_ids == [8, 9] and len(r.state_slots) == 3
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.spec_decode_tokens == {"a": [8, 9]}
    # one draft accepted + a correction: 2 tokens appended, one draft's KV rolled back
    ro = ModelRunnerOutput(["a"], [[8, 4]], [None], spec_token_ids=[[1, 2]],
                           num_draft_tokens=[2], num_accepted_tokens=[1], accepted_per_position=[1, 0])
    s.update_from_output(so, ro)
    assert r.output_token_ids == [5, 8, 4]
    assert r.num_computed_tokens == r.num_tokens - 1
    st = s.stats()
    assert st.spec_num_draft_tokens == 2 and st.spec_num_accepted_tokens == 1


def test_rejects_prompts_that_cannot_fit():
    s = make_sched(blocks=4, bs=4)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(req("big", 40))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("x", 2))
        s.add_request(req("x", 2))


def test_stress_random_aborts_leave_pools_full():
    """Thousands of short requests arriving over time, random aborts, a tight pool."""
    rnd = random.Random(0)
    s = make_sched(max_num_seqs=16, budget=48, blocks=40, bs=4, slots=16)
    n_added = 0
    finished = set()
    for it in range(4000):
        for _ in range(rnd.randint(0, 2)):
            if n_added < 2500:
                s.add_request(req(f"r{n_added}", rnd.randint(1, 20), max_tokens=rnd.randint(1, 12)))
                n_added += 1
        if rnd.random() < 0.1 and s.requests:
            victim = rnd.choice(list(s.requests))
            for o in s.finish_requests([victim]):
                finished.add(o.req_id)
        if s.has_unfinished_requests():
            _, outs = step(s)
            finished |= {o.req_id for o in outs if o.finish_reason}
        if it % 97 == 0:
            s.check_integrity()
        if n_added >= 2500 and not s.has_unfinished_requests():
            break
    assert n_added == 2500 and len(finished) == 2500
    assert not s.has_unfinished_requests() and not s.requests
    s.check_integrity()
    assert s.kv.pool.num_free == 40 and s.states.num_free == 16
    assert s.num_preemptions_total > 0
