"""Speculative decoding end to end on the tiny hybrid: outputs identical to no speculation (every
proposer, k = 1, 3, 5, with preemption and chunked prefill), and the state bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backboard import LLM, SamplingParams
from backboard.spec_decode.proposer import Proposer
from tests.models.test_engine import _requests, _run_staggered


class OracleProposer(Proposer):
    """Proposes the known greedy continuation, corrupted at random positions: exercises partial
    acceptance, full acceptance with a bonus token, and rejection at every position."""

    def __init__(self, cfg, expected: dict[tuple, list[int]], seed: int = 0) -> None:
        super().__init__(cfg)
        self.expected, self.rng = expected, np.random.default_rng(seed)

    def draft(self, plan, hidden, k, who):
        b = self.ctx.batch
        out = []
        for i in who:
            row = plan.rows[i]
            npr, n = int(b.num_prompt[row]), int(b.num_tokens[row])
            want = self.expected[tuple(b.token_ids[row, :npr].tolist())][n - npr:n - npr + k]
            d = [t if self.rng.random() > 0.25 else (t + 1) % 1000 for t in want]
            out.append(d)
        return out


@pytest.fixture(scope="module")
def reference(hybrid_model):
    prompts, params = _requests(seed=3)
    llm = LLM(hybrid_model, max_num_seqs=16, max_model_len=256)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return prompts, params, outs


def _llm_with_oracle(path, prompts, outs, k, **kw):
    llm = LLM(path, max_num_seqs=16, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": k, "adaptive": False}, **kw)
    oracle = OracleProposer(llm.config, {tuple(p): o for p, o in zip(prompts, outs)})
    llm.engine.runner.use_proposer(oracle)
    return llm


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_drafts_lossless(reference, hybrid_model, k):
    prompts, params, outs = reference
    llm = _llm_with_oracle(hybrid_model, prompts, outs, k)
    got = _run_staggered(llm, prompts, params)
    assert got == outs
    st = llm.stats()
    assert st["spec_num_accepted_tokens"] > 0.4 * st["spec_num_draft_tokens"]   # many accepted
    assert st["spec_mean_acceptance_length"] > 1.5
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("setting", ["preempting", "chunking"])
def test_oracle_drafts_with_preemption_and_chunking(reference, hybrid_model, setting):
    prompts, params, outs = reference
    kw = dict(num_kv_blocks=48, block_size=8) if setting == "preempting" else dict(max_num_batched_tokens=32)
    llm = _llm_with_oracle(hybrid_model, prompts, outs, 3, **kw)
    assert _run_staggered(llm, prompts, params) == outs
    if setting == "preempting":
        assert llm.engine.stats().num_preemptions_total >= 2
    llm.reset_prefix_cache()                          # cached prefixes hold blocks until then
    assert llm.engine.scheduler.kv.pool.num_free == llm.engine.runner.num_blocks


@pytest.mark.parametrize("method,k", [("mtp", 1), ("mtp", 3), ("ngram", 3), ("mtp", 5)])
def test_real_proposers_lossless(reference, hybrid_model, method, k):
    prompts, params, outs = reference
    llm = LLM(hybrid_model, max_num_seqs=16, max_model_len=256,
              speculative_config={"method": method, "num_speculative_tokens": k, "adaptive": False})
    assert _run_staggered(llm, prompts, params) == outs
    assert llm.stats()["spec_num_draft_tokens"] > 0


def test_seeded_sampling_with_speculation_depends_only_on_the_seeds(hybrid_model, reference):
    """With temperature > 0, a seeded request's accept and resample draws come from (seed,
    position) alone: engines with different global seeds give the same tokens. (That rejection
    sampling keeps the target distribution is test_rejection.py's chi-square test.)"""
    prompts, _, outs = reference
    sp = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, seed=i, ignore_eos=True) for i in range(8)]
    runs = []
    for engine_seed in (0, 7):
        llm = _llm_with_oracle(hybrid_model, prompts, outs, 3, seed=engine_seed)
        res = llm.generate(prompts[:8], sp)
        assert all(len(o.outputs[0].token_ids) == 10 for o in res)
        assert llm.stats()["spec_num_draft_tokens"] > 0
        runs.append([o.outputs[0].token_ids for o in res])
    assert runs[0] == runs[1]


def test_gdn_state_after_accepting_j_of_k(hybrid_model):
    """Verification writes the state after each draft position into its own slot: the slot of
    position j holds exactly the state of running the accepted tokens alone."""
    from backboard.forward_context import set_forward_context
    from backboard.worker.input_batch import BatchRequest, prepare_batch
    from tests.models.driver import FlatBatchDriver

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, 37).tolist()
    verify = rng.integers(0, 1000, 4).tolist()          # last token + 3 drafts
    d = FlatBatchDriver(hybrid_model, num_slots=16)
    d.step([(0, prompt)])
    r = d.reqs[0]
    slot0 = r["slot"]
    blocks = list(r["blocks"]) + [int(d.free_blocks.pop())]
    dst = [slot0, 10, 11, 12]
    pb = prepare_batch([BatchRequest(np.array(verify), len(prompt), blocks, slot0, dst)], d.block_size)
    caches = d.caches
    with torch.no_grad(), set_forward_context(pb.meta, caches):
        d.model(pb.input_ids, pb.meta.positions)
    for j in range(4):
        ref = FlatBatchDriver(hybrid_model, num_slots=16)
        ref.step([(0, prompt + verify[:j + 1])])
        s = ref.reqs[0]["slot"]
        assert torch.allclose(caches.ssm[:, dst[j]], ref.caches.ssm[:, s], atol=1e-5), j
        assert torch.allclose(caches.conv[:, dst[j]], ref.caches.conv[:, s], atol=1e-4), j
