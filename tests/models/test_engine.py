"""The engine end to end on the tiny hybrid: continuous batching is invisible in the output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backboard import LLM, SamplingParams
from tests.conftest import hf_reference

N_REQ = 32


def _requests(seed: int = 0):
    """32 prompts of mixed lengths (not multiples of 64) and output lengths."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(3, 150, N_REQ)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
              for m in rng.integers(4, 24, N_REQ)]
    return prompts, params


def _run_staggered(llm: LLM, prompts, params, seed: int = 1) -> list[list[int]]:
    """Add requests at different steps (a few per step) and step until all finish."""
    rng = np.random.default_rng(seed)
    ids, pending, done = {}, list(range(len(prompts))), {}
    while pending or llm.has_unfinished_requests():
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                i = pending.pop(0)
                ids[llm.add_request(prompts[i], params[i])] = i
        for o in llm.step():
            if o.finished:
                done[ids[o.request_id]] = o.outputs[0].token_ids
    return [done[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def expected(hybrid_model):
    """Each request alone (our engine) and transformers' greedy generate."""
    prompts, params = _requests()
    llm = LLM(hybrid_model, max_num_seqs=1, max_model_len=256)
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    ref = hf_reference(hybrid_model)
    hf = []
    for p, sp in zip(prompts[:8], params[:8]):
        with torch.no_grad():
            ids = torch.tensor([p])
            g = ref.generate(ids, max_new_tokens=sp.max_tokens, min_new_tokens=sp.max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        hf.append(g[0, len(p):].tolist())
    return prompts, params, alone, hf


def test_alone_matches_transformers(expected):
    prompts, params, alone, hf = expected
    assert alone[:8] == hf


@pytest.mark.parametrize("setting", ["plenty", "preempting", "chunking"])
def test_batched_equals_alone(expected, hybrid_model, setting):
    prompts, params, alone, _ = expected
    kw = dict(max_num_seqs=16, max_model_len=256)
    if setting == "preempting":
        kw.update(num_kv_blocks=40, block_size=8)         # 320 tokens for 16 running requests
    if setting == "chunking":
        kw.update(max_num_batched_tokens=24)              # every prompt > 24 tokens is chunked
    llm = LLM(hybrid_model, **kw)
    got = _run_staggered(llm, prompts, params)
    assert got == alone
    if setting == "preempting":
        assert llm.engine.stats().num_preemptions_total >= 3
    llm.engine.scheduler.check_integrity()
    llm.reset_prefix_cache()                          # cached prefixes hold blocks until then
    assert llm.engine.scheduler.kv.pool.num_free == llm.engine.runner.num_blocks
