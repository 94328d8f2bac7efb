"""Prompt logprobs under preemption and chunked prefill: one entry per prompt position, equal to
transformers' fp32 logprobs, on every architecture (and greedy tokens unchanged).

A preempted request is recomputed from scratch; its recomputed prompt positions must emit no
second set of prompt logprobs (vLLM's rule), and a chunk boundary must neither drop nor repeat a
position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backboard import LLM, SamplingParams
from tests.conftest import hf_reference

ARCHS = ["qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3", "qwen2", "llama"]
TOL = 2e-3
NUM_TOP = 3


def _prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, int(m)).tolist() for m in rng.integers(40, 90, n)]


def _ref_logprobs(ref, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32 log-softmax of transformers' logits; row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def _check_prompt_logprobs(plps, prompt: list[int], lp: torch.Tensor, what: str) -> None:
    assert len(plps) == len(prompt), f"{what}: {len(plps)} entries for {len(prompt)} prompt tokens"
    assert plps[0] is None
    for i in range(1, len(prompt)):
        d = plps[i]
        assert abs(d[prompt[i]] - float(lp[i - 1, prompt[i]])) < TOL, (what, i)
        top_v = lp[i - 1].topk(NUM_TOP).values.tolist()
        for t, v in d.items():              # every entry is the model's logprob of that token
            assert abs(v - float(lp[i - 1, t])) < TOL, (what, i, t)
        got_top = sorted(d.values(), reverse=True)[:NUM_TOP]
        assert len(d) >= NUM_TOP and np.allclose(got_top, top_v, atol=TOL), (what, i)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_under_preemption_and_chunking(tiny_models, arch):
    path = tiny_models(arch)
    prompts = _prompts()
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=NUM_TOP)
    # 24 blocks of 8 = 192 tokens for six requests of ~100 tokens; 32-token chunks
    llm = LLM(path, max_num_seqs=6, max_model_len=128, block_size=8, num_kv_blocks=24,
              max_num_batched_tokens=32, seed=0)
    outs = llm.generate(prompts, sp)
    assert llm.engine.stats().num_preemptions_total >= 3
    assert any(o.metrics.num_preemptions > 0 for o in outs)
    ref = hf_reference(path)
    for k, (prompt, out) in enumerate(zip(prompts, outs)):
        toks = out.outputs[0].token_ids
        lp = _ref_logprobs(ref, prompt + toks)
        _check_prompt_logprobs(out.prompt_logprobs, prompt, lp, f"{arch} request {k}")
        # greedy: every output token is transformers' argmax given the tokens before it
        want = lp[len(prompt) - 1:-1].argmax(-1).tolist()
        assert toks == want, f"{arch} request {k}"
        for j, d in enumerate(out.outputs[0].logprobs):
            assert abs(d[toks[j]] - float(lp[len(prompt) - 1 + j, toks[j]])) < TOL


def test_prompt_logprobs_with_n_and_preemption(tiny_models):
    """n > 1 children share one prompt: the parent's prompt logprobs are still one per position."""
    path = tiny_models("qwen3_5_text")
    prompts = _prompts(3, seed=4)
    sp = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, prompt_logprobs=NUM_TOP)
    llm = LLM(path, max_num_seqs=6, max_model_len=128, block_size=8, num_kv_blocks=20,
              max_num_batched_tokens=24, seed=0)
    outs = llm.generate(prompts, sp)
    assert llm.engine.stats().num_preemptions_total >= 1
    ref = hf_reference(path)
    for k, (prompt, out) in enumerate(zip(prompts, outs)):
        _check_prompt_logprobs(out.prompt_logprobs, prompt, _ref_logprobs(ref, prompt), f"n=2 request {k}")
