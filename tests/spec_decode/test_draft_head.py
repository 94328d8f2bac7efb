"""Draft-head training on CPU: a few minutes of distillation on the tiny test model reach a mean
acceptance length measurably above 1, and 4-bit quantization keeps most of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from backboard import LLM, SamplingParams
from backboard.config import ConfigError


def _acceptance(model, spec) -> tuple[float, list[list[int]]]:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(4, 40, 8)]
    llm = LLM(model, max_num_seqs=8, max_model_len=256, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    return llm.stats().get("spec_mean_acceptance_length", 1.0), [o.outputs[0].token_ids for o in outs]


def test_trained_head_accepts_and_int4_keeps_it(trained_draft_head, soft_model):
    path, stats = trained_draft_head
    # the format is documented and complete
    meta = json.load(open(os.path.join(path, "config.json")))
    assert meta["format"] == "backboard-draft-head" and meta["int8_lm_head"]
    assert all(g % 32 == 0 for g in meta["group_sizes"].values())
    # quantization keeps most of the float head's agreement with the teacher
    assert stats["heldout_top1_agreement_float"] > 0.1
    assert stats["heldout_top1_agreement_int4"] >= 0.7 * stats["heldout_top1_agreement_float"]
    acc, outs = _acceptance(soft_model, {"method": "draft_head", "draft_model": path,
                                          "num_speculative_tokens": 3, "adaptive": False})
    print(f"\nmean acceptance length with the int4 draft head (k=3): {acc:.3f}; training: {stats}")
    assert acc > 1.05
    _, base = _acceptance(soft_model, None)
    assert outs == base                                  # lossless


def test_untrained_head_accepts_less(trained_draft_head, soft_model, tmp_path):
    """The acceptance comes from training: a random-init head, quantized the same way, is worse."""
    from backboard.spec_decode.train import train_draft_head

    text = " ".join(["alpha beta gamma"] * 400)
    train_draft_head(soft_model, text, str(tmp_path), steps=0, seq_len=64, batch_size=2,
                             init="random", max_windows=2, log=lambda *a: None)
    acc0, _ = _acceptance(soft_model, {"method": "draft_head", "draft_model": str(tmp_path),
                                       "num_speculative_tokens": 3, "adaptive": False})
    acc1, _ = _acceptance(soft_model, {"method": "draft_head", "draft_model": trained_draft_head[0],
                                       "num_speculative_tokens": 3, "adaptive": False})
    assert acc1 > acc0


def test_quantize_cli_and_bad_folder(hybrid_model, tmp_path):
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "backboard.cli", "draft", "quantize", "--model", hybrid_model,
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    llm = LLM(hybrid_model, max_model_len=128, speculative_config={"method": "draft_head", "draft_model": str(out)})
    assert llm.generate(["hi"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(hybrid_model, max_model_len=128, speculative_config={"method": "draft_head", "draft_model": str(tmp_path)})


def test_draft_lm_head_by_rows(trained_draft_head, soft_model, monkeypatch):
    """Above dispatch.int8_lm_head_rows_max rows a bf16 target's own LM head drafts (on AMX and Zen 4 the
    INT8 one widened to fp32 ran 2-3x slower at 16 rows); at or below it, and for fp32 targets at
    every row count, the INT8 head does."""
    import torch

    from backboard.config import ModelConfig
    from backboard.ops import dispatch
    from backboard.spec_decode.draft_head import load_draft_head

    mc = ModelConfig.from_pretrained(soft_model, dtype="bfloat16")
    V, H = mc.vocab_size, mc.hidden_size
    w = torch.randn(V, H).bfloat16()
    calls = []

    def target(h):
        calls.append(h.shape[0])
        return torch.zeros(h.shape[0], V)

    monkeypatch.setattr(dispatch, "int8_lm_head_rows_max", lambda device: 2)
    _, lm = load_draft_head(trained_draft_head[0], mc, torch.bfloat16, w, target, 0, "cpu")
    h = torch.randn(3, H).bfloat16()
    assert lm.logits(h).abs().sum() == 0 and calls == [3]
    small = lm.logits(h[:2])
    assert small.shape == (2, V) and small.dtype == torch.float32 and small.abs().sum() > 0 and calls == [3]
    _, lm32 = load_draft_head(trained_draft_head[0], mc, torch.float32, w.float(), target, 0, "cpu")
    assert lm32.logits(h.float()).abs().sum() > 0 and calls == [3]


@pytest.mark.parametrize("widen", [False, True])
def test_int4_layers_widened_where_bf16_pays(trained_draft_head, soft_model, monkeypatch, widen):
    """Where dispatch.int4_widened_pays (AMX, Zen 4: bf16 ran the head's layers 1.1-10x faster than
    unpacking int4), a bf16 target's head holds each layer as the bf16 rounding of its int4
    weights; elsewhere it keeps the int4 layers. Both give the same drafts' inputs up to bf16."""
    import torch

    from backboard.config import ModelConfig
    from backboard.layers.linear import Int4Linear, Linear
    from backboard.models.weight_arena import arena_of
    from backboard.ops import dispatch
    from backboard.ops.quant import dequantize_int4
    from backboard.spec_decode.draft_head import load_draft_head

    mc = ModelConfig.from_pretrained(soft_model, dtype="bfloat16")
    w = torch.randn(mc.vocab_size, mc.hidden_size).bfloat16()
    monkeypatch.setattr(dispatch, "int4_widened_pays", lambda device: False)
    int4_head, _ = load_draft_head(trained_draft_head[0], mc, torch.bfloat16, w, None, 0, "cpu")
    monkeypatch.setattr(dispatch, "int4_widened_pays", lambda device: widen)
    head, _ = load_draft_head(trained_draft_head[0], mc, torch.bfloat16, w, None, 0, "cpu")
    for h in (int4_head, head):              # its weights packed in one buffer (models/weight_arena.py)
        assert len({arena_of(t) for t in [*h.parameters(), *h.buffers()]}) == 1
    pairs = [(n, m, int4_head.get_submodule(n)) for n, m in head.named_modules() if isinstance(m, (Linear, Int4Linear))]
    assert pairs and all(isinstance(m, Linear if widen else Int4Linear) for _, m, _ in pairs)
    for _, m, q in pairs:
        if widen:
            assert m.weight.dtype == torch.bfloat16
            assert torch.equal(m.weight, dequantize_int4(q.qweight, q.scales, q.group_size, torch.bfloat16))
        x = torch.randn(5, m.in_features).bfloat16()
        torch.testing.assert_close(m(x).float(), q(x).float(), rtol=3e-2, atol=3e-2)


def test_training_continues_from_a_saved_head(trained_draft_head, soft_model, tmp_path):
    """--init DIR starts from the saved head's dequantized weights: zero steps keep its int4
    weights bit for bit (a fresh start would not) and its held-out agreement; a folder that is
    not a draft head stops before the teacher's pass."""
    from safetensors.torch import load_file

    from backboard.spec_decode.train import train_draft_head

    path, stats = trained_draft_head
    text = " ".join(["alpha beta gamma"] * 400)
    out = tmp_path / "cont"
    train_draft_head(soft_model, text, str(out), steps=0, seq_len=64, batch_size=2, init=path,
                     max_windows=2, log=lambda *a: None)
    old, new = load_file(os.path.join(path, "draft_head.safetensors")), load_file(out / "draft_head.safetensors")
    qnames = [k for k in old if k.endswith(".qweight") and not k.startswith("lm_head")]
    assert qnames and all((old[k] == new[k]).all() for k in qnames)
    with pytest.raises(ConfigError, match="no config.json"):
        train_draft_head(soft_model, text, str(tmp_path / "x"), steps=0, init=str(tmp_path), log=lambda *a: None)


def test_quantization_aware_training_saves_the_head_it_trained(soft_model, tmp_path, monkeypatch):
    """With qat_frac the last part of training runs through the int4 values: the head keeps its
    float weights underneath (the optimizer's parameters) and the saved 4-bit head computes what
    the fake-quantized head computed, so its held-out agreement is the fake-quantized one's."""
    import torch

    from backboard.config import ModelConfig
    from backboard.spec_decode.draft_head import fake_quantize_head, quantize_head
    from backboard.spec_decode.train import init_head, train_draft_head

    head = init_head(ModelConfig.from_pretrained(soft_model, dtype="float32"), "random", 0)
    params = list(head.parameters())
    fake_quantize_head(head, 32)
    assert {id(p) for p in head.parameters()} == {id(p) for p in params}     # the optimizer's, still
    lin = head.fc
    before = lin.weight.detach().clone()
    fake_quantize_head(head, 32, on=False)
    assert not torch.equal(before, lin.weight) and any(lin.weight is p for p in params)
    fake_quantize_head(head, 32)
    x = torch.randn(3, lin.in_features)
    y_fake = lin(x).detach()
    fake_quantize_head(head, 32, on=False)
    quantize_head(head, 32)
    torch.testing.assert_close(head.fc(x), y_fake, rtol=1e-4, atol=1e-4)

    from backboard.spec_decode import train as train_mod

    calls = []
    real = train_mod.fake_quantize_head
    monkeypatch.setattr(train_mod, "fake_quantize_head",
                        lambda h, g, on=True: (calls.append((on, g)), real(h, g, on))[1])
    text = " ".join(["alpha beta gamma delta"] * 300)
    stats = train_draft_head(soft_model, text, str(tmp_path), steps=6, seq_len=64, batch_size=2, lr=1e-2,
                             max_windows=4, group_size=32, qat_frac=0.5, log=lambda *a: None)
    assert stats["qat_frac"] == 0.5 and stats["steps"] == 6
    assert calls == [(True, 32)] * 3 + [(False, 32)]       # steps 3-5 of 6 train through int4, then off
