"""The draft vocabulary: the INT8 LM head drafts over the training answers' most frequent tokens.
Its logits are the whole head's at those tokens, the drafts are token ids of the whole vocabulary,
the engine's output stays the target's, and a vocabulary that misses the answers' tokens gets no
draft accepted (so the head really drafts over it)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from backboard import LLM, SamplingParams
from backboard.config import ModelConfig
from backboard.spec_decode import draft_vocab as dv


def test_choose_ranks_by_frequency_and_covers(monkeypatch):
    tokens = np.array([5] * 50 + [3] * 30 + [7] * 15 + [9] * 5)
    assert dv.choose_draft_vocab(tokens, 2048, size=2).tolist() == [3, 5]
    monkeypatch.setattr(dv, "MULTIPLE", 1)
    assert dv.choose_draft_vocab(tokens, 2048, cover=0.8).tolist() == [3, 5]
    assert dv.choose_draft_vocab(tokens, 2048, cover=0.9).tolist() == [3, 5, 7]
    assert dv.choose_draft_vocab(tokens, 2048, cover=0.999).tolist() == [3, 5, 7, 9]
    monkeypatch.setattr(dv, "MULTIPLE", 8)
    # rounded up to 8: the 4 seen, then unseen tokens by id
    assert dv.choose_draft_vocab(tokens, 2048, cover=0.999).tolist() == [0, 1, 2, 3, 4, 5, 7, 9]
    assert dv.draft_vocab_for(tokens, 2048, "full") is None
    assert dv.draft_vocab_for(tokens, 6, 8) is None                  # the whole vocabulary anyway
    assert dv.draft_vocab_for(tokens, 2048, "3").tolist() == [3, 5, 7]
    assert dv.coverage(np.array([3, 5]), tokens) == 0.8
    with pytest.raises(ValueError, match="auto, full or a positive number"):
        dv.draft_vocab_for(tokens, 2048, "0")


def _head_copy(trained_draft_head, tmp_path) -> str:
    out = str(tmp_path / "head")
    shutil.copytree(trained_draft_head[0], out)
    return out


def _load(path, mc, dtype, w, target=None):
    from backboard.spec_decode.draft_head import load_draft_head

    return load_draft_head(path, mc, dtype, w, target, 0, "cpu")[1]


def test_draft_vocab_lm_head_is_the_whole_heads_columns(trained_draft_head, soft_model, tmp_path, monkeypatch):
    from backboard.ops import dispatch
    from backboard.spec_decode.draft_head import set_draft_vocab

    mc = ModelConfig.from_pretrained(soft_model, dtype="float32")
    w = torch.randn(mc.vocab_size, mc.hidden_size)
    path = _head_copy(trained_draft_head, tmp_path)
    set_draft_vocab(path, w, None)
    whole = _load(path, mc, torch.float32, w)
    ids = np.sort(np.random.default_rng(0).choice(mc.vocab_size, 200, replace=False))
    set_draft_vocab(path, w, ids, {"note": 1})
    meta = json.load(open(os.path.join(path, "config.json")))
    assert meta["draft_vocab_size"] == 200 and meta["stats"]["note"] == 1
    part = _load(path, mc, torch.float32, w)
    assert part.size == 200 and whole.size is None
    h = torch.randn(5, mc.hidden_size)
    cols = whole.logits(h)[:, torch.from_numpy(ids)]
    torch.testing.assert_close(part.logits(h), cols, rtol=0, atol=1e-5)
    assert part(h).tolist() == ids[cols.argmax(-1).numpy()].tolist()
    # a bf16 target above int8_lm_head_rows_max: its bf16 rows of the same tokens
    monkeypatch.setattr(dispatch, "int8_lm_head_rows_max", lambda device: 2)
    wb = w.bfloat16()
    part_bf16 = _load(path, mc, torch.bfloat16, wb)
    hb = h.bfloat16()
    ref = (hb.float() @ wb[torch.from_numpy(ids)].float().T)
    torch.testing.assert_close(part_bf16.logits(hb), ref, rtol=2e-2, atol=2e-2)
    assert part_bf16.logits(hb[:2]).shape == (2, 200)
    assert part_bf16(hb).tolist() == ids[part_bf16.logits(hb).argmax(-1).numpy()].tolist()


def test_context_tokens_outside_the_vocabulary():
    ctx = dv.ContextTokens(torch.tensor([0, 1, 2, 3]), 10)
    assert ctx.of("a", np.array([1, 7, 2, 7])).tolist() == [7]
    assert ctx.of("a", np.array([1, 7, 2, 7, 9, 3])).tolist() == [7, 9]      # only the new tokens scanned
    assert ctx.seen["a"][0] == 6
    assert ctx.union(["a", "b"], [np.array([1, 7, 2, 7, 9, 3]), np.array([5, 0, 9])]).tolist() == [5, 7, 9]
    assert ctx.of("a", np.array([4])).tolist() == [4]                        # shorter: recomputed from scratch
    ctx.keep_only(["b"])
    assert list(ctx.seen) == ["b"]
    head = dv.DraftLMHead(lambda h: h[:, :4].float(), token_ids=torch.tensor([0, 1, 2, 3]), rows=torch.eye(10))
    h = torch.tensor([[0.1, 0.2, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0]])
    assert head(h).tolist() == [1] and head(h, head.extra(np.array([5, 7]))).tolist() == [5]
    assert head.extra(np.zeros(0, np.int64)) is None


def _generate(model, spec):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(4, 40, 8)]
    llm = LLM(model, max_num_seqs=8, max_model_len=256, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    return llm.stats().get("spec_mean_acceptance_length", 1.0), [list(o.outputs[0].token_ids) for o in outs]


def test_engine_drafts_over_the_vocabulary(trained_draft_head, soft_model, tmp_path, monkeypatch):
    """Lossless with any vocabulary; one made of the tokens the target writes keeps the whole
    head's acceptance; one without them gets drafts accepted only through the requests' own
    context tokens (the target repeats its words), none without those."""
    from backboard.models.loader import load_model
    from backboard.spec_decode.draft_head import set_draft_vocab

    path = _head_copy(trained_draft_head, tmp_path)
    spec = {"method": "draft_head", "draft_model": path, "num_speculative_tokens": 3, "adaptive": False}
    _, base = _generate(soft_model, None)
    acc_whole, outs = _generate(soft_model, spec)
    assert outs == base and acc_whole > 1.05
    mc = ModelConfig.from_pretrained(soft_model, dtype="float32")
    w = load_model(mc).lm_head.weight.detach()
    written = np.unique(np.concatenate(base))
    set_draft_vocab(path, w, written)
    acc_in, outs = _generate(soft_model, spec)
    assert outs == base and acc_in >= acc_whole - 0.02
    set_draft_vocab(path, w, np.setdiff1d(np.arange(mc.vocab_size), written)[:64])
    acc_context, outs = _generate(soft_model, spec)
    assert outs == base and acc_context > 1.05
    monkeypatch.setattr(dv, "MAX_EXTRA", 0)
    acc_out, outs = _generate(soft_model, spec)
    assert outs == base and acc_out == 1.0


def test_training_saves_the_answers_vocabulary(soft_model, tmp_path):
    from backboard.spec_decode.corpus import TokenCorpus
    from backboard.spec_decode.train import set_vocab_from_corpus, train_draft_head

    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, 1000, 8).tolist(), rng.integers(0, 300, 40).tolist()) for _ in range(8)]
    corpus = TokenCorpus.of(seqs)
    stats = train_draft_head(soft_model, corpus, str(tmp_path), held_text=corpus, steps=0, seq_len=32,
                             batch_size=2, init="random", max_windows=2, draft_vocab=128, log=lambda *a: None)
    want = dv.choose_draft_vocab(corpus.answer_ids(), ModelConfig.from_pretrained(soft_model).vocab_size, size=128)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(tmp_path, "draft_head.safetensors"))
    assert saved["lm_head.token_ids"].tolist() == want.tolist() and saved["lm_head.qweight"].shape[0] == 128
    assert stats["draft_vocab_size"] == 128 and 0.3 < stats["draft_vocab_heldout_cover"] < 1.0
    assert set(want.tolist()) <= set(range(300))                     # answer tokens, not prompt ones
    full = set_vocab_from_corpus(soft_model, str(tmp_path), corpus, corpus, "full")
    assert full == {"draft_vocab_size": None}
    assert "lm_head.token_ids" not in load_file(os.path.join(tmp_path, "draft_head.safetensors"))
    assert "draft_vocab_size" not in json.load(open(os.path.join(tmp_path, "config.json")))


def test_vocab_cli_checks_the_head_folder_first(soft_model, tmp_path):
    """`backboard draft vocab` with a folder that is not a draft head stops at once with what to
    do (before writing the chat corpus, most of an hour on a real model); a bad --draft-vocab is
    a usage error."""
    import subprocess
    import sys

    cache = tmp_path / "cache"                 # where the corpus would be written

    def run(*a):
        return subprocess.run([sys.executable, "-m", "backboard.cli", "draft", "vocab", "--model", soft_model, *a],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "BACKBOARD_CACHE": str(cache)})

    r = run("--head", str(tmp_path))
    assert r.returncode == 2 and "no config.json" in r.stderr and "backboard draft train" in r.stderr
    assert not (cache / "draft-corpus").exists()
    r = run("--head", str(tmp_path), "--draft-vocab", "lots")
    assert r.returncode == 2 and "auto, full or a positive number" in r.stderr
