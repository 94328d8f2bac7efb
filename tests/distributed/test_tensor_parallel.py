"""Tensor parallelism on the CPU (gloo, 2 ranks: this process and one spawned worker): the
tiny hybrid and the tiny dense model give the logprobs of TP = 1 within float tolerance and the
same greedy tokens, also with n-gram, MTP and 4-bit draft-head speculation, preemption and prefix
caching; a head count the TP size does not divide is a config error; a rank that dies stops the
engine."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from backboard.config import ConfigError, EngineConfig
from backboard.engine.llm import LLM
from backboard.sampling_params import SamplingParams

PROMPTS = [np.random.default_rng(i).integers(0, 1000, n).tolist() for i, n in enumerate((40, 7, 23, 31))]
SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
BASE = {"max_model_len": 128, "max_num_seqs": 4, "cpu_threads": 1}


def _run(path: str, **settings) -> tuple[list, dict]:
    """(each prompt's (tokens, logprobs, prompt logprobs), the engine's counters: LLM.stats())."""
    with LLM(path, **{**BASE, **settings}) as llm:
        outs = llm.generate(PROMPTS, SP)
        stats = llm.stats()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs], stats


def _close(a: list[dict | None], b: list[dict | None], atol: float = 2e-3) -> bool:
    return all((x is None and y is None) or (set(x) == set(y) and all(abs(x[t] - y[t]) < atol for t in x))
               for x, y in zip(a, b, strict=True))


def _check(ref, got) -> None:
    for (t0, lp0, plp0), (t1, lp1, plp1) in zip(ref, got, strict=True):
        assert t1 == t0                                  # greedy: token for token
        assert _close(plp0, plp1) and _close(lp0, lp1)   # logits within float tolerance


def test_tp2_equals_tp1_dense(tiny_models):
    """Llama: q/k/v and o biases (the bias added once after the all-reduce), tied embedding."""
    path = tiny_models("llama")
    _check(_run(path)[0], _run(path, tensor_parallel_size=2)[0])


def test_tp2_equals_tp1_hybrid_with_speculation_and_preemption(tiny_models):
    """GDN heads and states split, gated attention; n-gram verify rows with preemption (8 blocks
    for 12 blocks of work), then the MTP head (split as the model's layers are)."""
    path = tiny_models("qwen3_5")
    ref, _ = _run(path)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}
    got, stats = _run(path, tensor_parallel_size=2, speculative_config=spec, num_kv_blocks=8)
    assert stats["num_preemptions"] >= 1
    _check(ref, got)
    got, _ = _run(path, tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [g[0] for g in got] == [r[0] for r in ref]


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_tp2_draft_head_equals_tp1(soft_model, trained_draft_head, monkeypatch, tmp_path, draft_vocab):
    """The 4-bit draft head whole on every rank (its own KV cache of every KV head) with its INT8
    LM head split by vocabulary (or whole on every rank over a draft vocabulary): the same greedy
    tokens as TP = 1 with the same head, the same drafts step by step (rank 0's), some of them
    accepted; with preemption too."""
    from backboard.spec_decode.mtp_proposer import MTPProposer

    head = trained_draft_head[0]
    if draft_vocab:                     # the tokens the target writes here, and some others
        head = _with_draft_vocab(soft_model, head, str(tmp_path / "head"))
        # a rank holds only its share of the target's LM head rows: under TP the draft vocabulary
        # drafts over its own tokens, without the context tokens TP = 1 adds (draft_vocab.MAX_EXTRA)
        monkeypatch.setattr("backboard.spec_decode.draft_vocab.MAX_EXTRA", 0)
    drafts: list[list[list[int]]] = []
    propose = MTPProposer.propose
    monkeypatch.setattr(MTPProposer, "propose", lambda self, *a: drafts.append(propose(self, *a)) or drafts[-1])
    spec = {"method": "draft_head", "draft_model": head, "num_speculative_tokens": 2, "adaptive": False}
    ref, ref_stats = _run(soft_model, speculative_config=spec)
    ref_drafts, drafts[:] = list(drafts), []
    got, stats = _run(soft_model, tensor_parallel_size=2, speculative_config=spec)
    _check(ref, got)
    assert drafts == ref_drafts and sum(len(d) for step in drafts for d in step) > 0
    assert stats["spec_num_accepted_tokens"] == ref_stats["spec_num_accepted_tokens"] > 0
    # 4 blocks (64 tokens) for 4 requests of up to 50: preempted 2-3 times with either head (8
    # blocks of 128-token sequences preempted once or not at all, by what the head drafted)
    got, stats = _run(soft_model, tensor_parallel_size=2, speculative_config=spec, num_kv_blocks=4, max_model_len=64)
    assert stats["num_preemptions"] >= 1 and stats["spec_num_accepted_tokens"] > 0
    _check(ref, got)


def _with_draft_vocab(model: str, head: str, out: str) -> str:
    import shutil

    from backboard.config import ModelConfig
    from backboard.models.loader import load_model
    from backboard.spec_decode.draft_head import set_draft_vocab

    ref, _ = _run(model)
    written = np.unique(np.concatenate([r[0] for r in ref]))
    shutil.copytree(head, out)
    mc = ModelConfig.from_pretrained(model, dtype="float32")
    set_draft_vocab(out, load_model(mc).lm_head.weight.detach(), np.union1d(written, np.arange(0, 1000, 7)))
    return out


def test_heads_not_divisible_is_a_config_error(tiny_models):
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        EngineConfig.create(tiny_models("qwen3_5"), tensor_parallel_size=3)


def test_dead_rank_stops_the_engine(tiny_models, monkeypatch):
    monkeypatch.setenv("BACKBOARD_CPU_KERNELS", "0")      # the torch references start faster
    llm = LLM(tiny_models("llama"), tensor_parallel_size=2, **BASE)
    try:
        proc = llm.engine.tp_workers.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(RuntimeError):      # the collective fails: the peer is gone
            llm.generate(PROMPTS[:1], SP)
    finally:
        llm.shutdown()
    assert not proc.is_alive()


def test_shard_arithmetic():
    from backboard.distributed.shard import VocabShard, even_range, head_range

    assert even_range(8, 2, 1) == (4, 8)
    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]   # KV heads replicated
    assert [VocabShard.of(10, 4, r) for r in (0, 3)] == [VocabShard(0, 3, 3), VocabShard(9, 10, 3)]
