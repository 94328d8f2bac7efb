"""While adaptive k keeps speculation off, the draft head runs nothing; its cache must still end
up complete: the target's hidden states of the skipped positions are kept (PendingRows) and the
next catch-up runs over them. Before, those positions stayed holes in the head's KV cache that
every later draft of the request attended over (SmolLM2 at C1: acceptance 1.25 while adaptive,
against 1.52 at a fixed k = 1, which kept adaptive k off)."""

from __future__ import annotations

import numpy as np
import torch

from backboard import LLM, SamplingParams
from backboard.spec_decode import adaptive
from backboard.spec_decode.mtp_proposer import MTPProposer, PendingRows


def test_pending_rows_spans():
    p = PendingRows(cap=5)
    a, b, c = (torch.full((n, 2), float(v)) for n, v in ((2, 1), (1, 2), (4, 3)))
    p.add("r", 10, a)
    p.add("r", 12, b)                       # continues the span
    assert p.take("r", 14) is None          # not the span ending at 14: dropped
    p.add("r", 10, a)
    p.add("r", 12, b)
    assert torch.equal(p.take("r", 13), torch.cat([a, b]))
    assert p.take("r", 13) is None          # taken once
    p.add("r", 0, a)
    p.add("r", 5, b)                        # a gap: the span restarts at 5
    assert torch.equal(p.take("r", 6), b)
    p.add("r", 0, c)
    p.add("r", 4, c)                        # 8 rows > cap 5: the oldest 3 dropped
    assert torch.equal(p.take("r", 8), torch.cat([c, c])[3:])
    p.add("r", 0, a)
    p.add("s", 0, a)
    p.keep_only(["s"])
    assert p.take("r", 2) is None and p.take("s", 2) is not None


def test_head_cache_has_no_holes_after_off_steps(trained_draft_head, soft_model, monkeypatch):
    """Speculation on one step in three (k = 3), off otherwise: every position of every request
    up to its last catch-up went through the head (contiguous from 0), and outputs stay those
    without speculation."""
    seen: dict[int, set[int]] = {}
    real_forward, real_catch_up = MTPProposer._forward, MTPProposer.catch_up
    state = {"catching_up": False, "step": 0}

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
        return 3 if state["step"] % 3 == 0 else 0

    monkeypatch.setattr(MTPProposer, "_forward", forward)
    monkeypatch.setattr(MTPProposer, "catch_up", catch_up)
    monkeypatch.setattr(adaptive.AdaptiveK, "choose", choose)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in (7, 19, 30, 12)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(soft_model, max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "draft_head", "draft_model": trained_draft_head[0],
                                  "num_speculative_tokens": 3})
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert len(seen) == 4
    for row, pos in seen.items():
        assert pos == set(range(max(pos) + 1)), (row, sorted(set(range(max(pos) + 1)) - pos)[:10])
        assert max(pos) > 30                # the head caught up well into the outputs
    base = LLM(soft_model, max_num_seqs=4, max_model_len=256)
    assert outs == [o.outputs[0].token_ids for o in base.generate(prompts, sp)]
