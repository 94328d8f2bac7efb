"""Small deterministic checkpoints for tests and demos, written through transformers' own
`save_pretrained`, plus a small byte-level BPE tokenizer trained with `tokenizers`.

Every supported architecture gets a preset that keeps the traps visible: GQA ratios > 1 for the
attention and the GDN heads, dk != dv, partial rotary, randomised norm weights (so `1 + w` vs `w`
cannot hide), MTP weights for the hybrids, sharded safetensors for some presets.

    build_tiny_checkpoint("/tmp/m", arch="qwen3_5")      # or: backboard tiny-model qwen3_5 /tmp/m
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from typing import Any

from backboard.config import DENSE_ARCHITECTURES as DENSE

ARCHS = ("qwen3_5", "qwen3_5_text", "qwen3_next", *DENSE)
PRESETS = ("tiny", "demo", "small")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# added tokens that decoding keeps in the text, as in Qwen's tokenizers: the reasoning and
# tool-call markers (their parsers read the text)
KEPT_IN_TEXT = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# ChatML, with Qwen3.5's tool calling (tools in the system turn, XML calls, tool results as user
# turns) and its thinking switch (enable_thinking opens <think> in the prompt, or closes it empty);
# without tools or enable_thinking a conversation renders as plain ChatML
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}"
    "{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nTo call a function, reply with:\n<tool_call>\n<function=NAME>\n"
    "<parameter=NAME>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and tools and loop.first -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{{- '\n<tool_call>\n<function=' + f['name'] + '>\n' -}}"
    "{%- for name, value in (f['arguments'] or {}) | items -%}"
    "{{- '<parameter=' + name + '>\n' -}}"
    "{%- if value is mapping or (value is sequence and value is not string) -%}{{- value | tojson -}}"
    "{%- else -%}{{- value | string -}}{%- endif -%}"
    "{{- '\n</parameter>\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' + '\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\n' -}}"
    "{%- elif enable_thinking is defined -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

_WORDS = (
    "the of and to in is was that for it with as his on be at by had are but from or have an they "
    "which one you were all her she there would their we him been has when who will no more if out "
    "so up said what about than into them can only other time new some could these two may first "
    "then do any like my now over such our man me even most made after also did many off before "
    "must well back through years much where your way down should because long each just state "
    "people those too how little good world very still own see men work day get here between both "
    "life being under never same another know while last might great old year came since against "
    "go come right used take three engine token model cache block batch request serve decode "
    "prefill kernel memory tensor layer state attention speed latency throughput graph stream "
    "python torch server client queue slot page scheduler sample logits prompt output input"
).split()
_SYLLABLES = "ka ri to mo na shi lu ve ra den por quin zel tha bro mi sa te ul or an en".split()


def _corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """A deterministic pseudo-English corpus with numbers, punctuation and a little code."""
    rng = random.Random(seed)
    pseudo = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(600)]
    vocab = _WORDS + pseudo
    lines = []
    for i in range(num_lines):
        kind = i % 7
        if kind == 5:
            a, b = rng.randint(0, 999), rng.randint(0, 99)
            lines.append(f"def f{a}(x, y={b}):\n    return x * {b} + y  # {rng.choice(vocab)}")
        elif kind == 6:
            lines.append(f"{rng.randint(1, 2030)}. {rng.choice(vocab).capitalize()}: "
                         f"{rng.random():.3f}, {rng.randint(0, 10**6)}!")
        else:
            n = rng.randint(5, 20)
            words = [rng.choice(vocab) for _ in range(n)]
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ";"]))
    return lines


def build_tokenizer(out_dir: str, vocab_size: int = 1000) -> int:
    """Train a byte-level BPE tokenizer (Qwen-like: ChatML specials) and save it with transformers.

    Returns the tokenizer's total size (base vocabulary + special tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in KEPT_IN_TEXT],
        clean_up_tokenization_spaces=False)
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in KEPT_IN_TEXT])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return len(fast)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _text_config(arch: str, preset: str, vocab_size: int) -> dict[str, Any]:
    if preset == "tiny":
        base: dict[str, Any] = dict(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
            max_position_embeddings=4096, initializer_range=0.08, tie_word_embeddings=False)
        hybrid = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=24, linear_conv_kernel_dim=4)
    elif preset == "demo":
        # GDN head dims of 128 (the real models' value; vLLM's CPU kernel needs it)
        base = dict(
            vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
            max_position_embeddings=32768, initializer_range=0.05, tie_word_embeddings=False)
        hybrid = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4)
    elif preset == "small":
        # Qwen3.5-0.8B shapes (hidden 1024, 8/2 heads of 256, GDN 16/16 heads of 128, SwiGLU 3584)
        # with 8 layers and a small vocabulary: the CPU benchmarks' model
        base = dict(
            vocab_size=vocab_size, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6,
            max_position_embeddings=32768, initializer_range=0.02, tie_word_embeddings=True)
        hybrid = dict(linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4)
    else:
        raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS}")
    if arch in DENSE:
        extra = dict(attention_bias=True, tie_word_embeddings=True) if arch == "llama" else {}
        return dict(base, **extra, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    cfg = dict(base, **hybrid, full_attention_interval=4, attn_output_gate=True,
               mtp_num_hidden_layers=1,
               rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                "partial_rotary_factor": 0.25})
    if arch in ("qwen3_5", "qwen3_5_text"):
        half = int(cfg["head_dim"] * 0.25) // 2           # rotary pairs, split over t / h / w
        cfg["rope_parameters"].update(mrope_section=[half - 2 * (half // 3), half // 3, half // 3],
                                      mrope_interleaved=True)
    if arch == "qwen3_next":
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, decoder_sparse_step=1, norm_topk_prob=True,
                   mlp_only_layers=[1])
    return cfg


def _hf_model(arch: str, text_cfg: dict[str, Any], eos_id: int, pad_id: int):
    import transformers as tf

    common = dict(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    if arch == "qwen3_5":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=text_cfg["hidden_size"])
        cfg = tf.Qwen3_5Config(text_config=dict(text_cfg, **common), vision_config=vision,
                               tie_word_embeddings=text_cfg["tie_word_embeddings"], **common)
        cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
        return tf.Qwen3_5ForConditionalGeneration(cfg)
    if arch == "qwen3_5_text":
        cfg = tf.Qwen3_5TextConfig(**text_cfg, **common)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
        return tf.Qwen3_5ForCausalLM(cfg)
    if arch == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**text_cfg, **common)
        cfg.architectures = ["Qwen3NextForCausalLM"]
        return tf.Qwen3NextForCausalLM(cfg)
    if arch in DENSE:
        name = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[arch]
        cfg = getattr(tf, f"{name}Config")(**text_cfg, **common)
        cfg.architectures = [f"{name}ForCausalLM"]
        return getattr(tf, f"{name}ForCausalLM")(cfg)
    raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHS}")


def _randomise_norms(model, seed: int) -> None:
    """Norm weights near 0 (zero-centred Norm0) or near 1 (plain norms), never exactly either."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("_norm.weight"):
                p.copy_(p + 0.2 * torch.randn(p.shape, generator=g))


def _mtp_state_dict(arch: str, text_cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """Random MTP head weights (`mtp.*`): fc [H, 2H], two pre-fc norms, one full-attention decoder
    layer, a final norm. transformers has no MTP module, so its decoder layer class is reused."""
    import torch
    import transformers as tf

    torch.manual_seed(seed + 2)
    cfg_cls = tf.Qwen3NextConfig if arch == "qwen3_next" else tf.Qwen3_5TextConfig
    layer_cfg = dict(text_cfg, num_hidden_layers=1, layer_types=["full_attention"])
    layer_cfg.pop("full_attention_interval", None)
    cfg = cfg_cls(**layer_cfg)
    if arch == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer as L
        cfg.mlp_only_layers = [0]  # the MTP layer of the tiny Next model uses a dense MLP
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as L
    layer = L(cfg, 0)
    h = text_cfg["hidden_size"]
    std = text_cfg["initializer_range"]
    sd: dict[str, torch.Tensor] = {}
    for k, v in layer.state_dict().items():
        if k.endswith("norm.weight") or "layernorm" in k:
            sd[f"mtp.layers.0.{k}"] = 0.2 * torch.randn(v.shape)
        else:
            sd[f"mtp.layers.0.{k}"] = std * torch.randn(v.shape)
    sd["mtp.fc.weight"] = std * torch.randn(h, 2 * h)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{n}.weight"] = 0.2 * torch.randn(h)
    return {k: v.contiguous() for k, v in sd.items()}


def _add_mtp_shard(out_dir: str, sd: dict[str, Any]) -> None:
    """Write the MTP weights as their own shard and list them in model.safetensors.index.json."""
    from safetensors.torch import save_file

    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    else:  # single file: turn it into a one-shard index
        from safetensors import safe_open

        with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
            keys = list(f.keys())
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}
    save_file(sd, os.path.join(out_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
    for k in sd:
        index["weight_map"][k] = "model-mtp.safetensors"
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


def build_tiny_checkpoint(out_dir: str, arch: str = "qwen3_5", preset: str = "tiny",
                          seed: int = 0, dtype: str = "float32", mtp: bool = True,
                          max_shard_size: str | None = None, init_std: float | None = None) -> str:
    """Write a deterministic checkpoint folder (config, safetensors, tokenizer, chat template).

    init_std overrides the preset's weight scale: small values (transformers' default 0.02) give a
    model whose next token depends mostly on the current one, with a learnable structure that
    speculative-decoding tests need; the default keeps layers strong so parity tests see every
    layer. Same arguments give the same bytes of weights. Returns out_dir."""
    import torch

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS}")
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=out_dir)
    try:
        tok_size = build_tokenizer(tmp, vocab_size=1000 if preset == "tiny" else 4000)
        with open(os.path.join(tmp, "tokenizer.json")) as f:
            added = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
        text_cfg = _text_config(arch, preset, vocab_size=_round_up(tok_size, 64))
        if init_std is not None:
            text_cfg["initializer_range"] = init_std
        torch.manual_seed(seed)
        model = _hf_model(arch, text_cfg, eos_id=added["<|im_end|>"], pad_id=added["<|endoftext|>"])
        _randomise_norms(model, seed)
        model = model.to(getattr(torch, dtype))
        if max_shard_size is None and arch in ("qwen3_5", "qwen3_next") and preset == "tiny":
            max_shard_size = "300KB"  # exercise sharded loading
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(tmp, **kw)
        if mtp and arch not in DENSE:
            sd = _mtp_state_dict(arch, text_cfg, seed)
            _add_mtp_shard(tmp, {k: v.to(getattr(torch, dtype)) for k, v in sd.items()})
        for name in os.listdir(tmp):
            dst = os.path.join(out_dir, name)
            if os.path.isdir(dst):
                shutil.rmtree(dst)
            os.replace(os.path.join(tmp, name), dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def default_cache_dir() -> str:
    base = os.environ.get("BACKBOARD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "backboard")
    return base


def ensure_demo_model(cache_dir: str | None = None) -> tuple[str, bool]:
    """The embedded default model: built on first use into the cache. Returns (path, built_now)."""
    path = os.path.join(cache_dir or default_cache_dir(), "models", "qwen3_5-demo")
    if os.path.isfile(os.path.join(path, "config.json")) and any(
            f.endswith(".safetensors") for f in os.listdir(path)):
        return path, False
    build_tiny_checkpoint(path, arch="qwen3_5_text", preset="demo", dtype="float32")
    return path, True
