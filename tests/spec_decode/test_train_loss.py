"""The draft-head training loss: the reduced loss vocabulary gives the full loss when it holds every
token, and the chained-draft inputs are the head's own outputs one position back."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def setup(tiny_models):
    from backboard.config import ModelConfig
    from backboard.spec_decode.train import Teacher, init_head, teacher_targets

    cfg = ModelConfig.from_pretrained(tiny_models("llama", init_std=0.02), dtype="float32")
    teacher = Teacher(cfg, 2, 24)
    seqs = np.random.default_rng(0).integers(0, 1000, (2, 24))
    head = init_head(cfg, "random", 0).eval()
    return head, teacher.model, seqs, teacher_targets(teacher, seqs)


def test_loss_vocab_of_every_token_is_the_full_loss(setup):
    from backboard.spec_decode.train import LossVocab, head_loss

    head, target, seqs, (h, top_lp, top_ids) = setup
    full, agree = head_loss(head, target, seqs, h, top_lp, top_ids)
    every = LossVocab.build([torch.arange(target.lm_head.weight.shape[0])], target.lm_head.weight)
    same, agree2 = head_loss(head, target, seqs, h, top_lp, top_ids, every)
    torch.testing.assert_close(same, full)
    assert agree == agree2
    few = LossVocab.build([top_ids[..., :2]], target.lm_head.weight)   # fewer tokens: a smaller loss
    assert len(few.ids) < target.lm_head.weight.shape[0]
    assert head_loss(head, target, seqs, h, top_lp, top_ids, few)[0] < full


def test_chained_hidden_is_the_heads_output_one_position_back(setup):
    from backboard.spec_decode.train import chained_hidden

    head, target, seqs, (h, _, _) = setup
    gen = torch.Generator().manual_seed(0)
    assert chained_hidden(head, target, seqs, h, 0.0, 2, gen) is h
    chained = chained_hidden(head, target, seqs, h, 1.0, 1, gen)
    L = seqs.shape[1]
    with torch.no_grad():
        own = head(target.embed_tokens(torch.from_numpy(seqs[0, 1:])), h[0, :-1], torch.arange(L - 1), dense=True)
    torch.testing.assert_close(chained[0, 1:], own)
    torch.testing.assert_close(chained[0, 0], h[0, 0])


def test_windows_weigh_the_heads_answer_targets():
    """The head at i predicts t_{i+2}: its weight is 1 exactly where that token is an answer token."""
    from backboard.spec_decode.corpus import TokenCorpus
    from backboard.spec_decode.train import windows

    corpus = TokenCorpus.of([(list(range(5)), list(range(100, 107))), (list(range(5, 9)), list(range(200, 210)))])
    assert corpus.starts.tolist() == [0, 12] and corpus.answer.sum() == 17
    ids, weight = windows(corpus, 8)
    assert ids.shape == (3, 8) and weight.shape == (3, 7)
    for w in range(3):
        np.testing.assert_array_equal(weight[w], corpus.answer[8 * w + 2:8 * w + 9])
        np.testing.assert_array_equal(ids[w], corpus.ids[8 * w:8 * w + 8])


def test_loss_counts_only_weighted_positions(setup):
    """Changing the teacher at positions of weight 0 (prompt tokens) leaves the loss and the
    agreement alone; at a weighted position it changes them."""
    from backboard.spec_decode.train import head_loss

    head, target, seqs, (h, top_lp, top_ids) = setup
    weight = torch.zeros(seqs.shape[0], seqs.shape[1] - 1)
    weight[:, 10:] = 1.0
    base, agree = head_loss(head, target, seqs, h, top_lp, top_ids, weight=weight)
    other_ids = top_ids.clone()
    other_ids[:, 1:11] = (other_ids[:, 1:11] + 7) % target.lm_head.weight.shape[0]   # targets of positions 0..9
    masked, agree2 = head_loss(head, target, seqs, h, top_lp, other_ids, weight=weight)
    torch.testing.assert_close(masked, base)
    assert agree2 == agree
    other_ids[:, 12] = (other_ids[:, 12] + 7) % target.lm_head.weight.shape[0]       # position 11: weighted
    assert not torch.allclose(head_loss(head, target, seqs, h, top_lp, other_ids, weight=weight)[0], base)
    full, _ = head_loss(head, target, seqs, h, top_lp, top_ids)
    torch.testing.assert_close(head_loss(head, target, seqs, h, top_lp, top_ids, weight=torch.ones_like(weight))[0],
                               full)


def test_corpus_shards_follow_the_model_not_its_folder(hybrid_model, tiny_models, tmp_path):
    """A copy of the model in another folder (a GGUF converted again lands in a new one) reads
    the same shards; another model with other weights does not."""
    import shutil

    from backboard.spec_decode.corpus import chat_asks, chat_corpus, model_fingerprint

    copy = str(tmp_path / "copy")
    shutil.copytree(hybrid_model, copy)
    other = tiny_models("qwen3_5", init_std=0.02)
    assert model_fingerprint(copy) == model_fingerprint(hybrid_model) != model_fingerprint(other)
    asks = chat_asks(["bees"], ["Why is {} important?"])
    gen = dict(max_tokens=4, shard=2, max_num_seqs=2, log=lambda *a: None)
    cache = tmp_path / "cache"
    chat_corpus(hybrid_model, asks, str(cache), **gen)
    chat_corpus(copy, asks, str(cache), **gen)
    assert len(list(cache.glob("shard-*.npz"))) == 1
    chat_corpus(other, asks, str(cache), **gen)
    assert len(list(cache.glob("shard-*.npz"))) == 2


def test_corpus_shards_are_reused_by_a_longer_or_cut_prompt_list(hybrid_model, tmp_path, monkeypatch):
    """The corpus is cached per shard, named by the shard's own prompts: a cut list reads its
    shards back and a longer one writes only the shards it adds (generation is most of the cost);
    the answers are the model's (greedy answers equal to a fresh generate)."""
    from backboard import SamplingParams
    from backboard.engine import llm as llm_mod
    from backboard.spec_decode.corpus import chat_asks, chat_corpus, chat_prompt_ids

    asks = chat_asks(["bees", "chess", "tea"], ["Why is {} important?", "Write a haiku about {}."])
    made = []
    real = llm_mod.LLM

    def counting(*a, **kw):
        made.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(llm_mod, "LLM", counting)
    gen = dict(max_tokens=8, shard=2, max_num_seqs=4, log=lambda *a: None)
    first = chat_corpus(hybrid_model, asks[:4], str(tmp_path), **gen)
    assert len(made) == 1 and len(list(tmp_path.glob("shard-*.npz"))) == 2
    cut = chat_corpus(hybrid_model, asks[:2], str(tmp_path), **gen)
    assert len(made) == 1 and np.array_equal(cut.ids, first.ids[:len(cut)])
    longer = chat_corpus(hybrid_model, asks, str(tmp_path), **gen)
    assert len(made) == 2 and len(list(tmp_path.glob("shard-*.npz"))) == 3
    assert np.array_equal(longer.ids[:len(first)], first.ids)
    # shard 0 holds asks 0 (T = 0.7, seed 0) and 1 (greedy): the greedy answer is the model's
    llm = real(hybrid_model, max_num_seqs=4, max_model_len=264)
    p = chat_prompt_ids(llm.get_tokenizer().hf, asks[1:2])[0]
    ans = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    s1 = int(first.starts[1])
    assert first.ids[s1:s1 + len(p)].tolist() == p
    assert first.ids[s1 + len(p):s1 + len(p) + len(ans.token_ids)].tolist() == list(ans.token_ids)
    assert first.answer[s1 + len(p):s1 + len(p) + len(ans.token_ids)].all() and not first.answer[s1:s1 + len(p)].any()
