"""Prefix caching in core/ (no tensors): the block pool's LRU, chained hashes, checkpoints, the
scheduler's resume points and copies, and a randomized stress against a simulated worker whose
caches have content (tests/unit/sim_worker.py)."""

from __future__ import annotations

import random

import pytest

from backboard.config import SchedulerConfig
from backboard.core.block_pool import BlockPool
from backboard.core.prefix_cache import PrefixCacheSettings, hash_block_tokens, request_block_hashes
from backboard.core.scheduler import Scheduler
from backboard.request import EngineCoreRequest, Request
from backboard.sampling_params import SamplingParams
from tests.unit.sim_worker import SimWorker, greedy, run_to_completion

VOCAB = 64


def make(blocks=256, bs=4, slots=None, k=0, max_num_seqs=8, budget=64, interval=0, caching=True,
         proposer_kv=False, max_len=512):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_len)
    pc = PrefixCacheSettings(checkpoint_interval=interval, proposer_has_kv=proposer_kv) if caching else None
    s = Scheduler(cfg, bs, blocks, slots, num_spec_tokens=k, prefix_cache=pc)
    w = SimWorker(blocks, bs, slots or 0, VOCAB)
    return s, w


def add(s, rid, prompt, max_tokens=6, eos=None, **sp):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=eos is None, **sp)
    s.add_request(Request(EngineCoreRequest(rid, list(prompt), params, (eos,) if eos is not None else ()),
                          max_model_len=512))


def run(s, w):
    return run_to_completion(s, w, check_every=1)


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


# ---- the block pool ---------------------------------------------------------------------------
def test_pool_lru_evicts_least_recently_freed_cached_block_first():
    p = BlockPool(4, enable_caching=True)
    a = p.allocate(4)
    for i, b in enumerate(a):
        assert p.cache_block(b, bytes([i]))
    p.free([a[2], a[0]])          # a2 freed first: evicted first
    p.free([a[1]])
    assert p.num_free == 3 and p.cached_block(bytes([2])) == a[2]
    assert p.allocate(1) == [a[2]] and p.cached_block(bytes([2])) is None
    assert p.cached_block(bytes([0])) == a[0]     # still cached-free
    p.touch([a[0]])                               # a hit takes it back out of the free queue
    assert p.num_free == 1 and p.ref_count(a[0]) == 1
    p.check_integrity([[a[0]], [a[2]], [a[3]]])
    with pytest.raises(AssertionError):
        p.check_integrity([[a[0]], [a[3]]])       # a2's owner missing


def test_pool_refresh_moves_cached_free_blocks_to_the_back_of_the_lru():
    p = BlockPool(4, enable_caching=True)
    a = p.allocate(4)
    for i, b in enumerate(a):
        assert p.cache_block(b, bytes([i]))
    p.free([a[0], a[1], a[2]])    # LRU order a0, a1, a2; a3 stays owned
    p.refresh([a[0], a[3]])       # a0 just used; an owned block is not in the queue: no change
    assert p.num_free == 3 and p.ref_count(a[3]) == 1
    assert p.allocate(2) == [a[1], a[2]]
    assert p.cached_block(bytes([0])) == a[0]
    p.check_integrity([[a[1]], [a[2]], [a[3]]])


def test_pool_dedupes_hashes_and_refuses_double_free():
    p = BlockPool(3, enable_caching=True)
    a, b = p.allocate(2)
    assert p.cache_block(a, b"h") and not p.cache_block(b, b"h")
    p.free([a])
    with pytest.raises(RuntimeError):
        p.free([a])
    p._ref[b] = 0                                  # corrupt: an owned block with ref 0
    with pytest.raises(AssertionError):
        p.check_integrity()


def test_block_hashes_chain_over_the_whole_prefix():
    sp = SamplingParams(max_tokens=1)
    r1 = Request(EngineCoreRequest("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], sp), 64)
    r2 = Request(EngineCoreRequest("b", [1, 2, 3, 4, 5, 6, 7, 8], sp), 64)
    r3 = Request(EngineCoreRequest("c", [0, 2, 3, 4, 5, 6, 7, 8], sp), 64)
    h1, h2, h3 = (request_block_hashes(r, 4) for r in (r1, r2, r3))
    assert len(h1) == 2 and h1 == h2                           # the partial block has no hash
    assert h3[0] != h1[0] and h3[1] != h1[1]                   # block 1 equal, its prefix not
    assert h1[1] == hash_block_tokens(h1[0], [5, 6, 7, 8])
    r1.append_token(10)
    r1.append_token(11)
    r1.append_token(12)
    assert len(request_block_hashes(r1, 4)) == 3 and r1.block_hashes[:2] == h2


# ---- plain models: blocks only ----------------------------------------------------------------
def test_dense_resumes_after_cached_blocks_and_copies_the_partial_block():
    s, w = make(slots=None)
    a = prompt(1, 18)
    add(s, "a", a)
    out_a = run(s, w)["a"]
    add(s, "a2", a)                       # the same prompt: 18 tokens, blocks of 4
    so = s.schedule()
    nr = so.new_reqs[0]
    assert nr.num_computed_tokens == 16 and so.num_scheduled_tokens == {"a2": 2}
    assert so.kv_block_copies == []       # 16 is block-aligned: nothing to copy
    out = s.update_from_output(so, w.execute(so))
    out_a2 = out[0].new_token_ids + run(s, w)["a2"]
    assert out_a2 == out_a == greedy(a, 6, VOCAB)
    add(s, "a3", a[:16])                  # 16 tokens, all cached: resume at 15 with a block copy
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 15 and len(so.kv_block_copies) == 1
    s.update_from_output(so, w.execute(so))
    run(s, w)
    assert s.stats().prefix_cache_hits == 16 + 15


def test_dense_proposer_kv_resumes_one_token_before_the_block_end():
    s, w = make(slots=None, proposer_kv=True)
    a = prompt(2, 18)
    add(s, "a", a)
    run(s, w)
    add(s, "b", a[:17] + [0])
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 15 and len(so.kv_block_copies) == 1


def test_dense_partial_block_a_hit_copies_from_stays_cached_while_used():
    """A hit that copies a chain's last block (with a proposer's KV: one token before its end)
    takes no reference on it; it must still count as used, or it ages out of the LRU while every
    repeat of the prompt resumes from it (SmolLM2's draft-head engine recomputed a block for a
    quarter of its requests)."""
    s, w = make(blocks=24, bs=4, slots=None, proposer_kv=True, max_num_seqs=1)
    a = prompt(4, 8)
    for i in range(12):
        add(s, f"a{i}", a, max_tokens=2)
        so = s.schedule()
        assert so.new_reqs[0].num_computed_tokens == (0 if i == 0 else 7), i
        assert len(so.kv_block_copies) == (0 if i == 0 else 1)
        s.update_from_output(so, w.execute(so))
        run(s, w)
        add(s, f"f{i}", prompt(100 + i, 18), max_tokens=2)   # 5 fresh blocks: the LRU turns over
        run(s, w)
    assert s.stats().prefix_cache_hits == 11 * 7


def test_caching_off_changes_nothing():
    s, w = make(slots=16, caching=False)
    a = prompt(3, 30)
    add(s, "a", a)
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 30}           # no chunk stop at the prompt's end
    s.update_from_output(first, w.execute(first))
    run(s, w)
    add(s, "b", a)
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 0 and not so.state_copies and not so.kv_block_copies
    assert s.prefix is None and s.kv.pool.num_cached == 0


# ---- hybrid models: state checkpoints ---------------------------------------------------------
def test_hybrid_prompt_end_checkpoint_then_same_prompt_again():
    """The prompt-end checkpoint (29 = P - 1) is taken inside the prompt's one chunk: no step
    more before the first token; the same prompt again resumes there."""
    s, w = make(slots=16)
    a = prompt(4, 30)
    add(s, "a", a, max_tokens=1)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 30} and len(so.state_snapshots["a"]) == 1
    assert so.state_snapshots["a"][0][0] == 29
    outs = s.update_from_output(so, w.execute(so))
    assert outs[0].new_token_ids and not s.has_unfinished_requests()     # one step, done
    assert sorted(c.num_tokens for c in s.prefix.store) == [29, 30]   # prompt end, the finished request
    add(s, "a2", a, max_tokens=4)
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 29 and so.num_scheduled_tokens == {"a2": 1}
    assert len(so.state_copies) == 1 and len(so.kv_block_copies) == 1    # 29 = 7 * 4 + 1
    s.update_from_output(so, w.execute(so))
    out = run(s, w)
    assert w.num_checked_resumes >= 1
    s.check_integrity()
    assert out["a2"][-3:] == greedy(a, 4, VOCAB)[1:]


def test_hybrid_snapshot_slot_comes_back_when_its_checkpoint_exists():
    """An equal checkpoint made while the step ran (by another request of the step): the
    snapshot's slot goes back to the pool instead of a second checkpoint."""
    s, w = make(slots=16)
    a = prompt(4, 30)
    add(s, "a", a, max_tokens=1)
    so = s.schedule()
    (p, slot), = so.state_snapshots["a"]
    s.prefix._checkpoint(s.requests["a"], p, s.states.take(), "prompt")     # the other request's
    free = s.states.num_free
    s.update_from_output(so, w.execute(so))
    assert s.states.num_free == free + 1 and slot in s.states._free          # a's own slot: the finish checkpoint
    assert sorted(c.num_tokens for c in s.prefix.store) == [29, 30]
    s.check_integrity()


def test_hybrid_multi_turn_resumes_from_the_finished_request():
    s, w = make(slots=16)
    p1 = prompt(5, 25)
    add(s, "t1", p1, max_tokens=7)
    out1 = run(s, w)["t1"]
    p2 = p1 + out1 + prompt(6, 9)
    add(s, "t2", p2, max_tokens=5)
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 25 + 7 - 1   # every token but the last sampled
    first = s.update_from_output(so, w.execute(so))[0].new_token_ids    # the rest of the prompt: a token
    out2 = first + run(s, w)["t2"]
    assert out2 == greedy(p2, 5, VOCAB)


def test_usage_counts_what_requests_hold_not_the_checkpoints():
    """Idle with checkpoints: the KV and slot usage gauges read 0 (what checkpoints pin is
    reclaimable; they have a gauge of their own); while a request runs, its blocks count."""
    s, w = make(slots=16)
    add(s, "a", prompt(8, 30), max_tokens=3)
    so = s.schedule()
    s.update_from_output(so, w.execute(so))
    st = s.stats()
    assert st.kv_cache_usage == pytest.approx(len(s.running[0].block_ids) / 256) and st.state_slot_usage > 0
    run(s, w)
    st = s.stats()
    assert st.prefix_cache_checkpoints >= 1 and s.kv.usage() > 0
    assert st.kv_cache_usage == 0 and st.state_slot_usage == 0


def test_hybrid_branch_point_checkpoint_serves_the_third_request():
    s, w = make(slots=16)
    system = prompt(7, 24)
    add(s, "a", system + prompt(8, 10))
    run(s, w)
    add(s, "b", system + prompt(9, 10))
    so = s.schedule()
    # b has a's 6 blocks cached but no state for them: it computes from 0, checkpointing at 23
    assert so.new_reqs[0].num_computed_tokens == 0 and so.num_scheduled_tokens == {"b": 34}
    assert [p for p, _ in so.state_snapshots["b"]] == [23, 33]      # and at its prompt's end
    s.update_from_output(so, w.execute(so))
    run(s, w)
    add(s, "c", system + prompt(10, 10))
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 23
    first = s.update_from_output(so, w.execute(so))[0].new_token_ids
    assert first + run(s, w)["c"] == greedy(system + prompt(10, 10), 6, VOCAB)


def test_hybrid_wave_sharing_a_cached_prefix_waits_for_the_first_checkpoint():
    """a leaves the system prompt's blocks but no state at the branch point; b, c, d arrive
    together: b computes from 0 and checkpoints at the branch point inside its chunk, c and d
    wait one step for that checkpoint and resume there, while e (no shared prefix) is admitted
    past them."""
    s, w = make(slots=16)
    system = prompt(7, 24)
    add(s, "a", system + prompt(8, 10))
    run(s, w)
    wave = {r: system + prompt(60 + i, 10) for i, r in enumerate("bcd")}
    for r, p in wave.items():
        add(s, r, p)
    add(s, "e", prompt(64, 12))
    so = s.schedule()
    assert [n.req_id for n in so.new_reqs] == ["b", "e"] and so.num_scheduled_tokens["b"] == 32
    assert so.state_snapshots["b"][0][0] == 23                 # (32: the prefill share of a contended step)
    s.update_from_output(so, w.execute(so))
    so = s.schedule()
    assert {n.req_id: n.num_computed_tokens for n in so.new_reqs} == {"c": 23, "d": 23}
    s.update_from_output(so, w.execute(so))
    out = run(s, w)
    assert all(out[r][-5:] == greedy(p, 6, VOCAB)[1:] for r, p in wave.items() if r != "b")
    assert w.num_checked_resumes >= 2


def test_hybrid_cold_wave_checkpoints_where_the_waiting_requests_branch():
    """Nothing cached: the first of a wave checkpoints where the requests behind it branch off."""
    s, w = make(slots=16)
    system = prompt(7, 26)
    for i in range(3):
        add(s, f"w{i}", system + prompt(70 + i, 9))
    so = s.schedule()
    assert [n.req_id for n in so.new_reqs] == ["w0"] and so.num_scheduled_tokens["w0"] == 32
    assert so.state_snapshots["w0"][0][0] == 23
    s.update_from_output(so, w.execute(so))
    so = s.schedule()
    assert {n.req_id: n.num_computed_tokens for n in so.new_reqs} == {"w1": 23, "w2": 23}


def test_waiting_for_a_leader_never_starves():
    """A leader too slow to reach the branch point (4 prefill tokens a step under the fair
    share): the waiting request is admitted after MAX_WAIT_STEPS steps, without a hit; a paused
    leader is never waited for."""
    from backboard.core.prefix_cache import MAX_WAIT_STEPS

    s, w = make(slots=16, budget=8)
    system = prompt(7, 200)
    add(s, "lead", system + prompt(80, 5))
    so = s.schedule()
    s.update_from_output(so, w.execute(so))
    add(s, "b", system + prompt(81, 5))
    steps = 0
    while "b" not in s.prefix._num_registered:      # admitted
        so = s.schedule()
        s.update_from_output(so, w.execute(so))
        steps += 1
    assert steps == MAX_WAIT_STEPS + 1 and s.requests["b"].num_cached_tokens == 0
    assert s.requests["lead"].num_computed_tokens < 199
    s.pause_requests(["lead", "b"])
    add(s, "c", system + prompt(82, 5))
    so = s.schedule()
    assert [n.req_id for n in so.new_reqs] == ["c"]
    s.update_from_output(so, w.execute(so))
    s.resume_requests(["lead", "b"])
    run(s, w)
    s.check_integrity()


def test_hybrid_prefix_hint_checkpoints_where_the_system_part_ends():
    """The front end's hint (a chat's system messages end at 22): a checkpoint is kept at 21,
    so the next request sharing only that part resumes there, though a alone ran before it."""
    s, w = make(slots=16)
    system = prompt(7, 22)
    s.add_request(Request(EngineCoreRequest("a", system + prompt(8, 10), SamplingParams(max_tokens=3,
                                            ignore_eos=True), prefix_hint=22), max_model_len=512))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 32} and so.state_snapshots["a"][0][0] == 21
    s.update_from_output(so, w.execute(so))
    run(s, w)
    b = system + prompt(9, 10)
    add(s, "b", b)
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 21 and len(so.kv_block_copies) == 1
    first = s.update_from_output(so, w.execute(so))[0].new_token_ids
    assert first + run(s, w)["b"] == greedy(b, 6, VOCAB)


def test_hybrid_interval_checkpoints_every_n_tokens():
    s, w = make(slots=32, interval=8, budget=256)
    a = prompt(11, 40)
    add(s, "a", a, max_tokens=1)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 40}          # one chunk, checkpoints inside it
    assert [p for p, _ in so.state_snapshots["a"]] == [7, 15, 23, 31, 39]     # 39 = P - 1
    s.update_from_output(so, w.execute(so))
    assert not s.has_unfinished_requests()
    add(s, "b", a[:21] + prompt(12, 10))         # shares 21 tokens: resumes at 15
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 15


def test_checkpoints_go_before_waiting_requests_are_refused():
    s, w = make(slots=4, max_num_seqs=4)           # slots for 4 requests, no spare
    for i in range(3):
        add(s, f"r{i}", prompt(20 + i, 20), max_tokens=2)
    run(s, w)
    assert len(s.prefix.store) > 0
    for i in range(4):
        add(s, f"n{i}", prompt(30 + i, 20), max_tokens=2)
    so = s.schedule()
    assert len(so.new_reqs) == 4                  # every checkpoint evicted for them
    s.update_from_output(so, w.execute(so))
    run(s, w)
    s.check_integrity()


def test_checkpoints_go_before_running_requests_are_preempted():
    s, w = make(blocks=24, slots=16, max_num_seqs=4)
    add(s, "a", prompt(40, 40), max_tokens=2)     # 10+ blocks, then pinned by checkpoints
    run(s, w)
    assert len(s.prefix.store) >= 1
    add(s, "b", prompt(41, 30), max_tokens=30)    # grows to 15 blocks while decoding
    add(s, "c", prompt(42, 20), max_tokens=10)
    run(s, w)
    assert s.num_preemptions_total == 0
    assert s.prefix.stats.checkpoints_evicted >= 1
    s.check_integrity()


def test_prompt_logprobs_requests_never_resume_from_the_cache():
    s, w = make(slots=16)
    a = prompt(50, 20)
    add(s, "a", a)
    run(s, w)
    add(s, "b", a, prompt_logprobs=1)
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 0


# ---- randomized stress ------------------------------------------------------------------------
@pytest.mark.parametrize("hybrid,k", [(True, 0), (True, 3), (False, 2)])
def test_stress_shared_prefixes_aborts_preemption_speculation(hybrid, k):
    """Thousands of requests: shared system prompts, multi-turn continuations, repeats, aborts,
    a pool small enough to preempt and evict. Every resume is checked against the simulated
    caches' content, every output against the greedy model, the allocators every step."""
    rng = random.Random(1234 + k)
    bs = 4
    s, _ = make(blocks=80, bs=bs, slots=(6 * (1 + k) + 10) if hybrid else None, k=k, max_num_seqs=6,
                budget=48, interval=12, max_len=160)
    w = SimWorker(s.kv.pool.num_blocks, bs, s.states.num_slots if hybrid else 0, VOCAB, draft_error=0.3, rng=rng)
    systems = [prompt(100 + i, rng.randrange(4, 40)) for i in range(5)]
    history: list[list[int]] = []
    expected: dict[str, list[int]] = {}
    outs: dict[str, list[int]] = {}
    aborted: set[str] = set()
    n_req = 0
    while n_req < 1500 or s.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3) if n_req < 1500 else 0):
            kind = rng.random()
            if kind < 0.3 and history:
                p = rng.choice(history)                             # the same prompt again
            elif kind < 0.6 and history:
                p = rng.choice(history)[:100] + prompt(rng.random(), rng.randrange(1, 12))  # next turn
            else:
                p = rng.choice(systems) + prompt(rng.random(), rng.randrange(1, 20))
            p = p[:120]
            rid = f"r{n_req}"
            n_req += 1
            mt = rng.randrange(1, 14)
            eos = 0 if rng.random() < 0.3 else None
            add(s, rid, p, max_tokens=mt, eos=eos)
            expected[rid] = greedy(p, mt, VOCAB, eos)
            history.append(p + expected[rid])
            if len(history) > 40:
                history.pop(0)
        if s.requests and rng.random() < 0.05:
            victim = rng.choice(list(s.requests))
            s.finish_requests([victim])
            aborted.add(victim)
        so = s.schedule()
        for o in s.update_from_output(so, w.execute(so)):
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
        s.check_integrity()
    for rid, exp in expected.items():
        got = outs.get(rid, [])
        if rid in aborted:
            assert got == exp[:len(got)], rid
        else:
            assert got == exp, rid
    st = s.stats()
    assert st.prefix_cache_hits > 0.1 * st.prefix_cache_queries      # the cache was used...
    assert s.num_preemptions_total > 0                                # ...under pressure
    assert w.num_checked_resumes > 100
    s.check_integrity()
    if hybrid:
        assert s.prefix.stats.checkpoints_evicted > 0 and s.prefix.stats.leader_waits > 0
        s.reset_prefix_cache()
        assert s.states.num_free == s.states.num_slots
    s.reset_prefix_cache()
    assert s.kv.pool.num_free == s.kv.pool.num_blocks and s.kv.pool.num_cached == 0
