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
