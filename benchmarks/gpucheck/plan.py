"""Shapes and models of gpu_check: the 27B / smoke plans, a ModelConfig of those dims, random weights."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from backboard.config import ModelConfig
from backboard.models.qwen3_5 import Qwen3_5ForCausalLM

GB = 1e9


# ==== shapes ====================================================================================
@dataclasses.dataclass
class Plan:
    smoke: bool
    device: torch.device
    dtype: torch.dtype
    dims: dict
    batch_sizes: tuple[int, ...]
    contexts: dict[str, int]              # label -> context tokens before the step
    verify: tuple[int, int]               # (requests, rows per request)
    prefill_lens: tuple[int, ...]
    block_size: int
    warmup: int
    reps: int
    check_dims: dict                      # shapes of the kernel checks
    budget_s: float


DIMS_27B = dict(vocab=248320, hidden=5120, inter=17408, layers=64, nh=24, nkv=4, hd=256,
                lk=16, lv=48, dk=128, dv=128)


DIMS_TINY = dict(vocab=256, hidden=64, inter=96, layers=2, nh=4, nkv=2, hd=32,
                 lk=2, lv=4, dk=32, dv=16, attn_every=2)    # [GDN, attention]


def make_plan(args: argparse.Namespace) -> Plan:
    if args.smoke:
        return Plan(True, torch.device("cpu"), torch.bfloat16, DIMS_TINY, (2,), {"short": 5, "long": 35},
                    (2, 2), (12,), 16, 0, 1,
                    dict(B=3, Bv=2, L=3, attn_B=2, attn_ctx=45, T=5, M=(1, 5), N=70, K=256,
                         groups=(32, 64), inter=40, e2e_layers=2, e2e_vocab=256, e2e_prompts=(19, 6)),
                    args.budget_s or 3600.0)      # the smoke test wants every section run
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --smoke to test the script on a CPU)")
    return Plan(False, torch.device("cuda"), torch.bfloat16, DIMS_27B, (1, 4, 16, 64),
                {"short": 128, "8k": 8192}, (64, 4), (1024, 8192), 16, 2, 5,
                dict(B=64, Bv=16, L=4, attn_B=16, attn_ctx=8192, T=256, M=(1, 16, 64), N=32768,
                     K=5120, groups=(32, 64, 128), inter=17408, e2e_layers=4, e2e_vocab=8192,
                     e2e_prompts=(300, 77)),
                args.budget_s or 420.0)


def model_config(dims: dict, num_layers: int | None = None, vocab: int | None = None,
                 max_len: int = 16384) -> ModelConfig:
    n = num_layers or dims["layers"]
    kw = dict(
        path="", model_type="qwen3_5_text", text_model_type="qwen3_5_text",
        architectures=("Qwen3_5ForCausalLM",), dtype="bfloat16",
        vocab_size=vocab or dims["vocab"], hidden_size=dims["hidden"],
        intermediate_size=dims["inter"], num_hidden_layers=n,
        num_attention_heads=dims["nh"], num_key_value_heads=dims["nkv"], head_dim=dims["hd"],
        rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25,
        max_position_embeddings=262144,
        layer_types=tuple("full_attention" if (i + 1) % dims.get("attn_every", 4) == 0 else "linear_attention"
                          for i in range(n)),
        attn_output_gate=True, norm_zero_centered=True, tie_word_embeddings=False,
        linear_num_key_heads=dims["lk"], linear_num_value_heads=dims["lv"],
        linear_key_head_dim=dims["dk"], linear_value_head_dim=dims["dv"],
        linear_conv_kernel_dim=4, gdn_projection_layout="split", mtp_num_hidden_layers=0,
        eos_token_ids=(), max_model_len=max_len)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in kw.items() if k in known})


@torch.no_grad()
def build_model(cfg: ModelConfig, plan: Plan, seed: int = 0) -> Qwen3_5ForCausalLM:
    with plan.device:
        model = Qwen3_5ForCausalLM(cfg, plan.dtype)
    g = torch.Generator(device=plan.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(1.0, 16.0, generator=g).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(-1.0, 1.0, generator=g))
        elif name.endswith("linear_attn.norm_weight"):          # plain norm: weights near 1
            p.normal_(1.0, 0.02, generator=g)
        elif "norm" in name:                                    # zero-centred: near 0
            p.normal_(0.0, 0.02, generator=g)
        elif name.endswith("conv1d_weight"):
            p.normal_(0.0, 0.3, generator=g)
        else:
            p.normal_(0.0, 0.02, generator=g)
    return model.eval()
