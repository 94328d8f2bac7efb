"""Prefix caching end to end on the tiny hybrid and the tiny dense model: A, then B and the next
chat turn of A sharing its prefix, then C (sharing the system prompt) and A again. Greedy output
with the cache is token for token the output without it, logprobs within 2e-3, with every
proposer, chunked prefill, preemption and checkpoint eviction; and the cache is actually hit."""

from __future__ import annotations

import re

import numpy as np
import pytest

from backboard import LLM, SamplingParams

MAX_TOKENS = 10
LEN = 256


def _prompts():
    rng = np.random.default_rng(7)
    system = rng.integers(0, 1000, 70).tolist()                  # 4 full blocks of 16, and 6 tokens
    return {"A": system + rng.integers(0, 1000, 30).tolist(),
            "B": system + rng.integers(0, 1000, 25).tolist(),
            "C": system + rng.integers(0, 1000, 20).tolist(),
            "new": rng.integers(0, 1000, 18).tolist(),
            "filler": rng.integers(0, 1000, 60).tolist()}


def _phases(out_a: list[int]) -> list[dict[str, list[int]]]:
    p = _prompts()
    return [{"A": p["A"]},
            {"B": p["B"], "turn2": p["A"] + out_a + p["new"], "filler": p["filler"]},
            {"C": p["C"], "A again": p["A"], "A prompt logprobs": p["A"]}]


def _run(llm: LLM, phases) -> dict[str, tuple[list[int], list[float], int, list[float]]]:
    """Each phase's prompts together; -> name: (token ids, chosen-token logprobs, cached tokens,
    prompt tokens' logprobs). The filler decodes long enough to push a tight KV cache into
    preemption; "A prompt logprobs" asks for prompt logprobs once A is cached."""
    out = {}
    for phase in phases:
        names = list(phase)
        sps = [SamplingParams(temperature=0, max_tokens=60 if n == "filler" else MAX_TOKENS, ignore_eos=True,
                              logprobs=1, prompt_logprobs=1 if "prompt" in n else None) for n in names]
        for name, o in zip(names, llm.generate([phase[n] for n in names], sps)):
            c = o.outputs[0]
            plp = [d[t] for d, t in zip(o.prompt_logprobs[1:], phase[name][1:])] if o.prompt_logprobs else []
            out[name] = (c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)], o.num_cached_tokens, plp)
    llm.engine.scheduler.check_integrity()
    return out


@pytest.fixture(scope="module")
def models(tiny_models, hybrid_model):
    return {"hybrid": hybrid_model, "dense": tiny_models("qwen3")}


@pytest.fixture(scope="module")
def draft_head(hybrid_model, tmp_path_factory):
    from backboard.spec_decode.train import quantize_mtp_head

    out = str(tmp_path_factory.mktemp("draft-head"))
    quantize_mtp_head(hybrid_model, out, 64)
    return out


@pytest.fixture(scope="module")
def reference(models):
    """Cache off, no speculation: the outputs every cached run must reproduce."""
    refs = {}
    for kind, path in models.items():
        llm = LLM(path, max_model_len=LEN, enable_prefix_caching=False)
        out_a = _run(llm, _phases([])[:1])["A"][0]
        phases = _phases(out_a)
        refs[kind] = (phases, _run(llm, phases))
    return refs


SPECS = {"none": None, "mtp": {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False},
         "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
         "draft_head": {"method": "draft_head", "num_speculative_tokens": 2, "adaptive": False}}
SETTINGS = {"plain": {}, "chunked": {"max_num_batched_tokens": 24},
            "preempting": {"num_kv_blocks": 11, "max_num_seqs": 4, "max_model_len": 160},
            "evicting": {"prefix_cache_checkpoints": 1, "max_num_seqs": 2}}
CASES = ([("hybrid", s, "plain") for s in SPECS] + [("hybrid", s, st) for s in ("none", "mtp") for st in
         ("chunked", "preempting", "evicting")] + [("hybrid", "ngram", "preempting"),
         ("hybrid", "draft_head", "chunked")] + [("dense", "none", st) for st in ("plain", "chunked", "preempting")]
         + [("dense", "ngram", st) for st in ("plain", "chunked")])   # these prompts never preempt it


@pytest.mark.parametrize("kind,spec,setting", CASES)
def test_cached_equals_uncached(models, reference, draft_head, kind, spec, setting):
    phases, ref = reference[kind]
    sc = SPECS[spec]
    if spec == "draft_head":
        sc = {**sc, "draft_model": draft_head}
    llm = LLM(models[kind], speculative_config=sc, **{"max_model_len": LEN, **SETTINGS[setting]})
    got = _run(llm, phases)
    for name, (toks, lps, _, plps) in ref.items():
        assert got[name][0] == toks, (name, got[name][0], toks)
        assert np.allclose(got[name][1], lps, atol=2e-3, rtol=0), name
        assert len(got[name][3]) == len(plps) and np.allclose(got[name][3], plps, atol=2e-3, rtol=0), name
    assert len(ref["A prompt logprobs"][3]) == len(phases[0]["A"]) - 1
    cached = {n: c for n, (_, _, c, _) in got.items()}
    if setting == "preempting":
        assert llm.engine.stats().num_preemptions_total >= 1
    if setting == "evicting" and kind == "hybrid":
        assert llm.engine.scheduler.prefix.stats.checkpoints_evicted >= 1
    if setting != "plain":
        return
    n_a = len(phases[0]["A"])
    assert cached["A"] == 0
    assert cached["A again"] >= (n_a - 1 if kind == "hybrid" else n_a // 16 * 16)
    assert cached["turn2"] >= (n_a + MAX_TOKENS - 1 if kind == "hybrid" else (n_a + MAX_TOKENS) // 16 * 16 - 1)
    assert cached["C"] >= 63                      # the system prompt's 4 full blocks (a branch point)
    assert cached["A prompt logprobs"] == 0       # prompt logprobs need every position computed
    st = llm.stats()
    assert st["prefix_cache_hits"] == sum(cached.values())
    if kind == "hybrid":                          # on by default; the start-up line counts checkpoints
        m = re.search(r"; (\d+) more for prefix-cache state checkpoints\); prefix caching on", llm.engine.describe())
        assert m and int(m.group(1)) == llm.config.scheduler.max_num_seqs >= 1


def test_caching_off_is_off(models):
    """--no-enable-prefix-caching: no snapshots, no copies, no cached blocks, no checkpoints."""
    llm = LLM(models["hybrid"], max_model_len=LEN, enable_prefix_caching=False)
    p = _prompts()["A"]
    llm.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
    so = llm.engine.scheduler.schedule()
    assert so.num_scheduled_tokens == {next(iter(so.num_scheduled_tokens)): len(p)}
    assert not so.kv_block_copies and not so.state_copies and not so.state_snapshots
    llm.engine.scheduler.update_from_output(so, llm.engine.runner.execute_model(so))
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.engine.scheduler.prefix is None and llm.engine.scheduler.kv.pool.num_cached == 0
    assert llm.engine.runner.num_slots == 64                  # no checkpoint slots
    assert "prefix caching off" in llm.engine.describe()


def _wave_phases() -> list[dict[str, list[int]]]:
    """E alone (leaves system prompt a's blocks, no state where the others branch off), then a
    wave sharing a, then a cold wave sharing system prompt b."""
    rng = np.random.default_rng(11)
    sys_a, sys_b = (rng.integers(0, 1000, 70).tolist() for _ in range(2))
    return [{"E": sys_a + rng.integers(0, 1000, 20).tolist()},
            {f"w{i}": sys_a + rng.integers(0, 1000, 15 + i).tolist() for i in range(3)},
            {f"c{i}": sys_b + rng.integers(0, 1000, 15 + i).tolist() for i in range(3)}]


@pytest.fixture(scope="module")
def wave_reference(models):
    return _run(LLM(models["hybrid"], max_model_len=LEN, enable_prefix_caching=False), _wave_phases())


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_wave_sharing_a_system_prompt_resumes_from_one_checkpoint(models, wave_reference, spec):
    """Requests arriving together with a shared system prompt: the first computes it and
    checkpoints where they branch off, the others wait for that checkpoint and resume there
    (exact: same greedy tokens as cache off), whether its blocks were cached before or not."""
    llm = LLM(models["hybrid"], max_model_len=LEN, speculative_config=SPECS[spec])
    got = _run(llm, _wave_phases())
    for name, (toks, lps, _, _) in wave_reference.items():
        assert got[name][0] == toks, (name, got[name][0], toks)
        assert np.allclose(got[name][1], lps, atol=2e-3, rtol=0), name
    cached = {n: c for n, (_, _, c, _) in got.items()}
    assert cached["w0"] == cached["c0"] == 0
    assert all(cached[n] == 63 for n in ("w1", "w2", "c1", "c2")), cached     # 4 shared blocks of 16
    assert llm.engine.scheduler.prefix.stats.leader_waits >= 2
