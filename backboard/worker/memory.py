"""How many KV blocks and state slots fit, and their allocation."""

from __future__ import annotations

import torch

from backboard.config import ModelConfig
from backboard.worker.forward_context import ModelCaches

GiB = 1 << 30


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                       num_attn_layers: int | None = None) -> int:
    n = len(cfg.attn_layer_ids) if num_attn_layers is None else num_attn_layers
    return n * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


def state_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
    n = len(cfg.gdn_layer_ids)
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * dtype.itemsize
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return n * (conv + ssm)


def allocate_caches(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu",
                    extra_attn_layers: int = 0) -> ModelCaches:
    """KV caches for every attention layer (plus `extra_attn_layers`, e.g. the MTP layer, which
    share the block tables) and GDN states for `num_slots` slots (+1 scratch slot at the end for
    padded rows). Zero-initialised."""
    n_attn = len(cfg.attn_layer_ids) + extra_attn_layers
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_attn)]
    v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_attn)]
    conv = ssm = None
    n_gdn = len(cfg.gdn_layer_ids)
    if n_gdn:
        conv = torch.zeros(n_gdn, num_slots + 1, cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim,
                           dtype=dtype, device=device)
        ssm = torch.zeros(n_gdn, num_slots + 1, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, dtype=torch.float32, device=device)
    return ModelCaches(k=k, v=v, conv=conv, ssm=ssm)
