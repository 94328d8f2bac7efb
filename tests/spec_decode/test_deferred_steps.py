"""While adaptive k keeps speculation off, the draft head runs nothing; its cache must still end
up complete: the target's hidden states of the skipped positions are kept (DeferredSteps) and the
next catch-up runs over them. Before, those positions stayed holes in the head's KV cache that
every later draft of the request attended over (SmolLM2 at C1: acceptance 1.25 while adaptive,
against 1.52 at a fixed k = 1, which kept adaptive k off)."""

from __future__ import annotations

import numpy as np
import torch

from backboard import LLM, SamplingParams
from backboard.spec_decode import adaptive
from backboard.spec_decode.deferred import DeferredSteps
from backboard.spec_decode.mtp_proposer import MTPProposer


def _step(log: DeferredSteps, reqs: dict[str, tuple[int, int]], extra_rows: int = 1) -> torch.Tensor:
    """One step off: reqs {req_id: (position, rows known)}, each request with extra_rows more rows
    in the flat batch than it has known (its rows are the first ones). Returns hidden [T, 2]:
    every row distinct."""
    q = [n + extra_rows for _, n in reqs.values()]
    start = np.concatenate([[0], np.cumsum(q)[:-1]]).astype(np.int64)
    hidden = torch.randn(int(sum(q)), 2)
    log.add(list(reqs), np.array([p for p, _ in reqs.values()]), np.array([n for _, n in reqs.values()]),
            start, hidden)
    return hidden


def _rows(hidden: torch.Tensor, reqs: dict[str, tuple[int, int]], rid: str, extra_rows: int = 1) -> torch.Tensor:
    at = 0
    for r, (_, n) in reqs.items():
        if r == rid:
            return hidden[at:at + n]
        at += n + extra_rows
    raise KeyError(rid)


def test_deferred_steps_spans():
    log = DeferredSteps(cap=5, max_rows=100)
    s1 = {"r": (10, 2)}
    s2 = {"r": (12, 1)}
    h1, h2 = _step(log, s1), _step(log, s2)
    assert log.take(["r"], np.array([14])) == [None]        # not the span ending at 14
    assert not log.steps                                      # the log is emptied by a take
    h1, h2 = _step(log, s1), _step(log, s2)
    out = log.take(["r"], np.array([13]))
    assert torch.equal(out[0], torch.cat([_rows(h1, s1, "r"), _rows(h2, s2, "r")]))
    assert log.take(["r"], np.array([13])) == [None]        # taken once
    _step(log, {"r": (0, 2)})
    h = _step(log, {"r": (5, 1)})                            # a gap: only the rows after it
    assert torch.equal(log.take(["r"], np.array([6]))[0], h[:1])
    c1, c2 = {"r": (0, 4)}, {"r": (4, 4)}
    h1, h2 = _step(log, c1), _step(log, c2)                  # 8 rows > cap 5: the oldest 3 dropped
    assert torch.equal(log.take(["r"], np.array([8]))[0], torch.cat([h1[:4], h2[:4]])[3:])


def test_deferred_steps_many_requests():
    """Requests interleaved in the flat batch, one absent from a step, one never deferred."""
    log = DeferredSteps(cap=50, max_rows=100)
    s1, s2, s3 = {"r": (0, 2), "s": (0, 3)}, {"s": (3, 1)}, {"s": (4, 1), "r": (2, 1)}
    h1, h2, h3 = _step(log, s1), _step(log, s2), _step(log, s3)
    s, r, t = log.take(["s", "r", "t"], np.array([5, 3, 0]))
    assert torch.equal(s, torch.cat([_rows(h1, s1, "s"), _rows(h2, s2, "s"), _rows(h3, s3, "s")]))
    assert torch.equal(r, torch.cat([_rows(h1, s1, "r"), _rows(h3, s3, "r")]))
    assert t is None


def test_deferred_steps_memory_bound():
    """Past max_rows the oldest steps go: their positions become holes (the rows after them come
    back alone)."""
    log = DeferredSteps(cap=50, max_rows=6)
    hs = [_step(log, {"r": (i, 1)}) for i in range(5)]      # 2 rows a step in the log
    assert log.num_rows == 6 and len(log.steps) == 3
    assert torch.equal(log.take(["r"], np.array([5]))[0], torch.cat([h[:1] for h in hs[2:]]))


def test_deferred_steps_ring_wraps():
    """The rows live in a ring: a step that does not fit before its end goes to its start, and
    every older step whose rows it takes (or that lies past the old head: older still) is gone;
    the rows kept are copies (the caller's tensor may change after add)."""
    log = DeferredSteps(cap=50, max_rows=10)
    sizes = {"a": 1, "b": 6, "c": 0, "d": 1, "e": 8}            # known rows; each step has 1 row more
    hs = {r: _step(log, {r: (0, n)}) for r, n in sizes.items()}  # a@0 b@2 c@9 d@0 (wrap) e@0 (wrap)
    assert log.num_rows == 9 and len(log.steps) == 1
    want = hs["e"][:8].clone()
    hs["e"].zero_()
    d, e = log.take(["d", "e"], np.array([1, 8]))
    assert d is None and torch.equal(e, want)
    assert log.num_rows == 0 and not log.steps


def test_deferred_steps_ring_grows_to_its_bound():
    """The ring starts at first_rows and doubles while a step does not fit before its end (rows
    kept where they were), up to max_rows; past that it wraps."""
    log = DeferredSteps(cap=50, max_rows=24, first_rows=4)
    hs = [_step(log, {"r": (2 * i, 2)}) for i in range(7)]   # 3 rows a step: 21 rows, none dropped
    assert len(log.ring) == 24 and log.num_rows == 21 and len(log.steps) == 7
    assert torch.equal(log.take(["r"], np.array([14]))[0], torch.cat([h[:2] for h in hs]))
    hs = [_step(log, {"r": (2 * i, 2)}) for i in range(9)]   # 27 rows > 24: the oldest goes
    assert len(log.ring) == 24 and len(log.steps) == 8
    assert torch.equal(log.take(["r"], np.array([18]))[0], torch.cat([h[:2] for h in hs[1:]]))


def _catch_up_positions(monkeypatch, model, head, dormant: bool):
    """Speculation on one step in three (k = 3), off otherwise (adaptive dormant on the off steps
    when `dormant`): -> (the positions of each request's rows that went through the head in
    catch-ups, the rows kept by the k = 0 steps at most, outputs, outputs without speculation)."""
    seen: dict[int, set[int]] = {}
    real_forward, real_catch_up = MTPProposer._forward, MTPProposer.catch_up
    state = {"catching_up": False, "step": 0, "kept": 0}

    def forward(self, ids, hidden, q_lens, num_computed, rows):
        if state["catching_up"]:
            for r, nc, q in zip(rows, num_computed, q_lens):
                seen.setdefault(int(r), set()).update(range(int(nc), int(nc) + int(q)))
        return real_forward(self, ids, hidden, q_lens, num_computed, rows)

    def catch_up(self, plan, hidden):
        state["catching_up"] = True
        try:
            return real_catch_up(self, plan, hidden)
        finally:
            state["catching_up"] = False

    def choose(self, n):
        state["step"] += 1
        if dormant and state["step"] % 3 != 0:
            self._dormant.add(adaptive.batch_class(n))
        else:
            self._dormant.discard(adaptive.batch_class(n))
        return 3 if state["step"] % 3 == 0 else 0

    def defer(self, plan, hidden):
        real_defer(self, plan, hidden)
        state["kept"] = max(state["kept"], self.deferred.num_rows)

    real_defer = MTPProposer.defer
    monkeypatch.setattr(MTPProposer, "_forward", forward)
    monkeypatch.setattr(MTPProposer, "catch_up", catch_up)
    monkeypatch.setattr(MTPProposer, "defer", defer)
    monkeypatch.setattr(adaptive.AdaptiveK, "choose", choose)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in (7, 19, 30, 12)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(model, max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "draft_head", "draft_model": head, "num_speculative_tokens": 3})
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert llm.engine.runner.proposer.deferred.num_rows <= state["kept"]
    base = LLM(model, max_num_seqs=4, max_model_len=256)
    return seen, state["kept"], outs, [o.outputs[0].token_ids for o in base.generate(prompts, sp)]


def test_head_cache_has_no_holes_after_off_steps(trained_draft_head, soft_model, monkeypatch):
    """Every position of every request up to its last catch-up went through the head
    (contiguous from 0), and outputs stay those without speculation."""
    seen, kept, outs, base = _catch_up_positions(monkeypatch, soft_model, trained_draft_head[0], dormant=False)
    assert len(seen) == 4 and kept > 0
    for row, pos in seen.items():
        assert pos == set(range(max(pos) + 1)), (row, sorted(set(range(max(pos) + 1)) - pos)[:10])
        assert max(pos) > 30                # the head caught up well into the outputs
    assert outs == base


def test_dormant_speculation_keeps_nothing(trained_draft_head, soft_model, monkeypatch):
    """Off confirmed by the probes (AdaptiveK.dormant): the k = 0 steps keep no hidden states
    (SmolLM2's draft-head engine at C16: its off steps ran 2-5% slower than none's while they
    did), a catch-up covers its own step only, and outputs stay exact."""
    seen, kept, outs, base = _catch_up_positions(monkeypatch, soft_model, trained_draft_head[0], dormant=True)
    assert kept == 0 and len(seen) == 4
    assert all(len(pos) < max(pos) + 1 for pos in seen.values())     # the off steps' positions: holes
    assert outs == base


def test_a_step_with_nothing_to_draft_keeps_its_rows_after_a_dormant_one(trained_draft_head, soft_model, monkeypatch):
    """Dormancy is the choice of the step that chose: a step whose rows are all prompt chunks
    (nothing sampled, no choice) keeps its rows for the catch-up, even after a dormant step."""
    kept = []
    real_defer = MTPProposer.defer

    def defer(self, plan, hidden):
        real_defer(self, plan, hidden)
        kept.append(int(self.deferred.num_rows))

    def choose(self, n):
        self._dormant.add(adaptive.batch_class(n))
        return 0

    monkeypatch.setattr(MTPProposer, "defer", defer)
    monkeypatch.setattr(adaptive.AdaptiveK, "choose", choose)
    rng = np.random.default_rng(7)
    short, long = (rng.integers(0, 1000, n).tolist() for n in (5, 60))
    llm = LLM(soft_model, max_num_seqs=1, max_model_len=256, max_num_batched_tokens=16,
              speculative_config={"method": "draft_head", "draft_model": trained_draft_head[0],
                                  "num_speculative_tokens": 3})
    llm.generate([short, long], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(kept) >= 3 and kept[-1] >= 40      # the long prompt's chunks, after the short one's dormant steps
