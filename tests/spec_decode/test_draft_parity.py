"""The serving proposer feeds the draft head exactly what training fed it: for the same sequence,
the first-draft logits the engine computes (paged attention, the head's KV cache kept in step by
catch-up, chained drafts written and overwritten) equal the training path's (dense attention over
the teacher's hidden states). A wrong hidden state (pre-norm, the wrong position, an off-by-one
between token and hidden) or a wrong LM head makes them differ."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backboard import LLM, SamplingParams


@pytest.fixture(scope="module")
def dense_model(tiny_models):
    return tiny_models("llama", init_std=0.02)          # the SmolLM2 architecture


@pytest.fixture(scope="module")
def head_dir(dense_model, tmp_path_factory):
    from backboard.spec_decode.train import train_draft_head

    out = str(tmp_path_factory.mktemp("parity-head"))
    train_draft_head(dense_model, " ".join(["alpha beta gamma delta"] * 200), out, steps=0, seq_len=32,
                     batch_size=2, init="random", max_windows=2, log=lambda *a: None)
    return out


def _engine_first_drafts(model: str, head: str, prompt: list[int], k: int):
    """-> the sequence generated, and [(position of the head's row, logits of draft 1)] per step."""
    llm = LLM(model, max_num_seqs=1, max_model_len=256, dtype="float32",
              speculative_config={"method": "draft_head", "draft_model": head, "num_speculative_tokens": k,
                                  "adaptive": False})
    prop = llm.engine.runner.proposer
    calls: list[list] = []
    lm_head, draft = prop.draft_lm.logits, prop.draft

    def record_lm(h):
        out = lm_head(h)
        if len(calls[-1]) == 1:                          # the first LM head call of a draft is draft 1
            calls[-1].append(out[0].clone())
        return out

    def record_draft(plan, hidden, k, who):
        calls.append([int(prop._last_pos[who][0])])
        return draft(plan, hidden, k, who)

    prop.draft_lm.logits, prop.draft = record_lm, record_draft
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return np.array(prompt + list(out[0].outputs[0].token_ids), dtype=np.int64), calls


def test_proposer_first_draft_logits_equal_training_path(dense_model, head_dir, k=3):
    from backboard.config import ModelConfig
    from backboard.spec_decode.draft_head import load_draft_head
    from backboard.spec_decode.train import Teacher, draft_logits

    prompt = np.random.default_rng(3).integers(0, 1000, 17).tolist()
    seq, calls = _engine_first_drafts(dense_model, head_dir, prompt, k)
    assert len(calls) >= 10
    cfg = ModelConfig.from_pretrained(dense_model, dtype="float32")
    teacher = Teacher(cfg, 1, len(seq))
    with torch.inference_mode():
        h, _ = teacher(seq[None])
        head, lm = load_draft_head(head_dir, cfg, torch.float32, teacher.model.lm_head.weight,
                                   teacher.model.compute_logits, attn_idx=0, device="cpu")
        train = draft_logits(head, teacher.model, seq[None], h, lm.logits)        # row i predicts seq[i + 2]
    for pos, logits in calls:
        torch.testing.assert_close(logits, train[pos], atol=2e-3, rtol=2e-3,
                                   msg=lambda m, pos=pos: f"draft-1 logits at position {pos}: {m}")
        assert int(logits.argmax()) == int(train[pos].argmax())
