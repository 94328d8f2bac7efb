"""Config parsing and checkpoint loading: formats, remapping, and the errors users see."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backboard.config import ConfigError, ModelConfig, SpecConfig, normalize_dtype
from backboard.models.loader import Checkpoint, CheckpointError, load_model, normalize_key


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_vlm_layout_config(hybrid_model):
    cfg = ModelConfig.from_pretrained(hybrid_model)
    assert cfg.model_type == "qwen3_5" and cfg.text_model_type == "qwen3_5_text"
    assert cfg.layer_types[3] == "full_attention" and cfg.layer_types[0] == "linear_attention"
    assert cfg.attn_layer_ids == [3, 7] and len(cfg.gdn_layer_ids) == 6
    assert cfg.rotary_dim == 8 and cfg.partial_rotary_factor == 0.25
    assert cfg.attn_output_gate and cfg.norm_zero_centered and cfg.mtp_num_hidden_layers == 1
    assert cfg.linear_key_head_dim != cfg.linear_value_head_dim
    assert cfg.linear_num_value_heads > cfg.linear_num_key_heads
    assert cfg.num_attention_heads > cfg.num_key_value_heads


def test_dense_and_moe_configs(tiny_models):
    dense = ModelConfig.from_pretrained(tiny_models("qwen3"))
    assert not dense.is_hybrid and not dense.norm_zero_centered and not dense.attn_output_gate
    assert dense.rotary_dim == dense.head_dim
    nxt = ModelConfig.from_pretrained(tiny_models("qwen3_next"))
    assert nxt.gdn_projection_layout == "grouped" and nxt.num_experts == 8
    assert nxt.is_moe_layer(0) and not nxt.is_moe_layer(1)  # mlp_only_layers=[1]


def test_full_attention_interval_and_layer_types():
    base = dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=16, intermediate_size=32,
                num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=8)
    c = ModelConfig.from_dict(dict(base, full_attention_interval=3))
    assert c.attn_layer_ids == [2, 5]
    c = ModelConfig.from_dict(dict(base, layer_types=["full_attention"] + ["linear_attention"] * 5))
    assert c.attn_layer_ids == [0]
    with pytest.raises(ConfigError, match="unsupported layer types"):
        ModelConfig.from_dict(dict(base, layer_types=["mamba"] * 6))


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(str(tmp_path))
    msg = str(e.value)
    assert "gpt2" in msg and all(a in msg for a in ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3", "qwen2", "llama"))


def test_dense_attention_variants_follow_the_config(tiny_models):
    """q/k norm and biases as each dense architecture means them: Qwen3 norms q and k, Qwen2 has
    q/k/v biases and no norm, Llama neither unless attention_bias (the tiny llama sets it: q/k/v
    and o_proj biases, tied embeddings)."""
    q3, q2, ll = (ModelConfig.from_pretrained(tiny_models(a)) for a in ("qwen3", "qwen2", "llama"))
    assert (q3.qk_norm, q3.qkv_bias, q3.o_bias) == (True, False, False)
    assert (q2.qk_norm, q2.qkv_bias, q2.o_bias) == (False, True, False)
    assert (ll.qk_norm, ll.qkv_bias, ll.o_bias, ll.tie_word_embeddings) == (False, True, True, True)
    assert all(not c.is_hybrid and not c.norm_zero_centered for c in (q3, q2, ll))
    base = json.loads(open(os.path.join(tiny_models("llama"), "config.json")).read())
    with pytest.raises(ConfigError, match="mlp_bias"):
        ModelConfig.from_dict(dict(base, mlp_bias=True))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="not a directory"):
        ModelConfig.from_pretrained(str(tmp_path / "nope"))


def test_dtypes():
    assert normalize_dtype("auto", "bfloat16") == "bfloat16"
    assert normalize_dtype("auto", None) == "float32"
    assert normalize_dtype("bf16") == "bfloat16"
    with pytest.raises(ConfigError, match="dtype must be one of"):
        normalize_dtype("int3")


def test_spec_config_parse():
    s = SpecConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}')
    assert s.method == "ngram" and s.num_speculative_tokens == 2
    with pytest.raises(ConfigError, match="method must be one of"):
        SpecConfig.parse({"method": "eagle9"})
    with pytest.raises(ConfigError, match="unknown speculative config keys"):
        SpecConfig.parse({"method": "mtp", "bogus": 1})


def test_key_normalisation():
    assert normalize_key("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert normalize_key("model.visual.blocks.0.attn.qkv.weight") is None
    assert normalize_key("mtp.fc.weight") == "mtp.fc.weight"
    assert normalize_key("lm_head.weight") == "lm_head.weight"


def test_sharded_checkpoint_and_vlm_keys(hybrid_model):
    ck = Checkpoint(hybrid_model)
    assert os.path.isfile(os.path.join(hybrid_model, "model.safetensors.index.json"))
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in ck
    assert not any(k.startswith("model.visual") for k in ck.keys())
    assert any(k.startswith("mtp.") for k in ck.keys())


def test_joined_projections_built_at_load(hybrid_model):
    cfg = ModelConfig.from_pretrained(hybrid_model)
    model = load_model(cfg)
    ck = Checkpoint(hybrid_model)
    gdn = model.layers[0].linear_attn
    want = torch.cat([ck.get(f"model.layers.0.linear_attn.in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")])
    assert torch.equal(gdn.in_proj.weight, want)
    attn = model.layers[3].self_attn
    want = torch.cat([ck.get(f"model.layers.3.self_attn.{p}_proj.weight") for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, want)
    mlp = model.layers[3].mlp
    want = torch.cat([ck.get(f"model.layers.3.mlp.{p}_proj.weight") for p in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, want)


def test_dtype_cast_at_load(hybrid_model):
    cfg = ModelConfig.from_pretrained(hybrid_model, dtype="bfloat16")
    model = load_model(cfg)
    assert model.layers[0].linear_attn.in_proj.weight.dtype == torch.bfloat16
    assert model.layers[0].linear_attn.A_log.dtype == torch.float32  # kept fp32


def _edit_single_file(path: str, edit) -> None:
    """Apply edit(dict) to the shard that holds the first layer's tensors."""
    idx = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    for fn in files:
        sd = load_file(os.path.join(path, fn))
        if edit(sd):
            save_file(sd, os.path.join(path, fn), metadata={"format": "pt"})
            if os.path.exists(idx):  # keep the index true to the files
                index = json.load(open(idx))
                wm = {k: v for k, v in index["weight_map"].items() if v != fn}
                wm.update({k: fn for k in sd})
                index["weight_map"] = wm
                json.dump(index, open(idx, "w"))
            return
    raise AssertionError("nothing edited")


def test_missing_tensor_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models("qwen3"), tmp_path / "m")
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_single_file(path, lambda sd: sd.pop(name, None) is not None)
    with pytest.raises(CheckpointError) as e:
        load_model(ModelConfig.from_pretrained(path))
    assert "missing tensor" in str(e.value) and name in str(e.value) and "[96, 64]" in str(e.value)


def test_shape_mismatch_names_both_shapes(tiny_models, tmp_path):
    path = _copy(tiny_models("qwen3"), tmp_path / "m")
    name = "model.layers.2.self_attn.o_proj.weight"

    def edit(sd):
        if name not in sd:
            return False
        sd[name] = torch.zeros(64, 100)
        return True
    _edit_single_file(path, edit)
    with pytest.raises(CheckpointError) as e:
        load_model(ModelConfig.from_pretrained(path))
    msg = str(e.value)
    assert name in msg and "[64, 100]" in msg and "[64, 128]" in msg


def test_unexpected_tensor_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models("qwen3"), tmp_path / "m")

    def edit(sd):
        sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(3, 3)
        return True
    _edit_single_file(path, edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.mlp\.extra_proj\.weight"):
        load_model(ModelConfig.from_pretrained(path))


def test_unknown_architecture_in_loader_path(tiny_models, tmp_path):
    path = _copy(tiny_models("qwen3"), tmp_path / "m")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["model_type"] = "mistral"
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ConfigError, match="unsupported architecture.*mistral"):
        ModelConfig.from_pretrained(path)


def test_tiny_checkpoint_is_deterministic(tmp_path):
    from backboard.models.tiny import build_tiny_checkpoint

    a = build_tiny_checkpoint(str(tmp_path / "a"), arch="qwen3")
    b = build_tiny_checkpoint(str(tmp_path / "b"), arch="qwen3")
    sa, sb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # norms randomised: neither all-zero nor all-one
    w = sa["model.layers.0.input_layernorm.weight"]
    assert w.std() > 0.05 and not torch.allclose(w, torch.ones_like(w))
