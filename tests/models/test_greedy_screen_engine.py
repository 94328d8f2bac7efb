"""The engine's greedy steps on the LM head's INT8 screen (sample/greedy_screen.py): on a bf16
model on the CPU the runner builds the screen, takes it for steps of few plain greedy rows (and not
for logprobs, sampling or more rows), and every request's tokens are the ones the full LM head's
argmax gives."""

from __future__ import annotations

import numpy as np
import pytest

from backboard import LLM, SamplingParams
from backboard.ops import dispatch
from backboard.worker import model_runner


def _prompts(n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 1000, int(k)).tolist() for k in rng.integers(5, 60, n)]


@pytest.fixture(scope="module")
def screened_calls():
    calls = []
    real = model_runner.screened_argmax
    model_runner.screened_argmax = lambda h, w, s: calls.append(h.shape[0]) or real(h, w, s)
    yield calls
    model_runner.screened_argmax = real


def _generate(path: str, params: SamplingParams, max_num_seqs: int) -> list[list[int]]:
    llm = LLM(path, dtype="bfloat16", max_model_len=256, max_num_seqs=max_num_seqs)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]


def test_screened_greedy_tokens_are_the_full_heads(hybrid_model, screened_calls, monkeypatch):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    screened = _generate(hybrid_model, greedy, max_num_seqs=2)
    assert screened_calls and max(screened_calls) <= 2          # every step had 1-2 logit rows
    n = len(screened_calls)
    monkeypatch.setattr(dispatch, "argmax_screen_rows_max", lambda device: 0)
    full = _generate(hybrid_model, greedy, max_num_seqs=2)
    assert len(screened_calls) == n                             # the second engine had no screen
    assert screened == full


def test_steps_that_need_logits_or_many_rows_do_not_screen(hybrid_model, screened_calls):
    del screened_calls[:]
    llm = LLM(hybrid_model, dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    assert llm.engine.runner.screen is not None
    with_lps = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    out = llm.generate(_prompts(2), with_lps)               # two rows: few enough to screen
    assert all(len(o.outputs[0].logprobs) == 6 for o in out)
    sampled = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=1)
    llm.generate(_prompts(2), sampled)
    assert screened_calls == []
    staggered = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True) for i in range(8)]
    llm.generate(_prompts(8), staggered)                   # 8 rows, then fewer as requests finish
    assert screened_calls and max(screened_calls) <= llm.engine.runner.screen_rows < 8
