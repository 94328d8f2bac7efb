"""The MTP draft head (`mtp.*` weights of Qwen3.5 / Qwen3-Next checkpoints).

Draft step at position i: x = fc(cat(Norm0(embed(t_{i+1})), Norm0(h_i))) (embedding first; h_i the
main model's final-normed hidden state), x = decoder_layer(x) at RoPE position i with the head's
own KV cache, h' = norm(x); lm_head(h') predicts t_{i+2}. For k > 1 drafts the layer is reused
with h' as the next h. The embedding and LM head are the main model's (not parameters here).

The same structure with 4-bit weights is our own draft head (spec_decode/draft_head.py)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from backboard.config import ModelConfig
from backboard.layers.linear import Linear
from backboard.layers.norm import RMSNorm
from backboard.models.loader import Checkpoint, load_weights
from backboard.models.qwen3_5 import DecoderLayer, layer_weight_specs
from backboard.models.weights import WeightSpec


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, attn_idx: int, moe: bool = False) -> None:
        super().__init__()
        H, eps, zc = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_zero_centered
        self.cfg = replace(cfg, layer_types=("full_attention",), num_hidden_layers=1,
                           mlp_only_layers=() if moe else (0,))
        self.pre_fc_norm_embedding = RMSNorm(H, eps, dtype, zc)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, dtype, zc)
        self.fc = Linear(2 * H, H, dtype)
        self.layers = nn.ModuleList([DecoderLayer(self.cfg, 0, dtype, attn_idx=attn_idx, moe=moe)])
        self.norm = RMSNorm(H, eps, dtype, zc)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                dense: bool = False) -> torch.Tensor:
        """embeds, hidden [T, H] -> the head's normed hidden state [T, H]. dense=True: one whole
        sequence with plain causal attention and no cache (training)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        h, residual = self.layers[0](x, None, positions, dense=dense)
        return self.norm(h, residual)[0]

    # ---- weights ---------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, WeightSpec]:
        return layer_weight_specs(self.cfg, self.layers[0], "mtp.layers.0", "layers.0")

    @staticmethod
    def checkpoint_name(param: str) -> str:
        return "mtp." + param


def load_mtp_head(cfg: ModelConfig, dtype: torch.dtype, attn_idx: int, device: str = "cpu") -> MTPHead:
    """Build the MTP head and load `mtp.*` from the checkpoint (the MoE form when its layer has
    experts)."""
    from backboard.models.loader import CheckpointError

    ckpt = Checkpoint(cfg.path)
    if not any(k.startswith("mtp.") for k in ckpt.keys()):
        raise CheckpointError(f"checkpoint {cfg.path} has no MTP weights (mtp.*): use another "
                              "speculative method (ngram, draft_head)")
    moe = "mtp.layers.0.mlp.experts.0.gate_proj.weight" in ckpt
    with torch.device(device):
        head = MTPHead(cfg, dtype, attn_idx, moe=moe)
    load_weights(head, ckpt, head.weight_specs(), head.checkpoint_name, is_ignored=lambda k: False,
                 owned=lambda k: k.startswith("mtp."))
    return head.eval()
