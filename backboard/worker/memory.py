"""How many KV blocks and state slots fit, and their allocation."""

from __future__ import annotations

import numpy as np
import torch

from backboard.config import ModelConfig
from backboard.constants import spec_token_margin
from backboard.core.prefix_cache import PrefixCacheSettings
from backboard.forward_context import ModelCaches

GiB = 1 << 30


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                       num_attn_layers: int | None = None, num_kv_heads: int | None = None) -> int:
    """Bytes of K and V one block holds over `num_attn_layers` layers (default: the model's) of
    `num_kv_heads` heads each (default: the config's)."""
    n = len(cfg.attn_layer_ids) if num_attn_layers is None else num_attn_layers
    nkv = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
    return n * 2 * block_size * nkv * cfg.head_dim * dtype.itemsize


def state_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
    n = len(cfg.gdn_layer_ids)
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * dtype.itemsize
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return n * (conv + ssm)


def allocate_caches(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu",
                    extra_attn_layers: int = 0, extra_kv_heads: int | None = None) -> ModelCaches:
    """KV caches for every attention layer (plus `extra_attn_layers`, e.g. the MTP layer, which
    share the block tables; of `extra_kv_heads` heads, default the config's) and GDN states for
    `num_slots` slots (+1 scratch slot at the end for padded rows). Zero-initialised."""
    nkv = [cfg.num_key_value_heads] * len(cfg.attn_layer_ids)
    nkv += [cfg.num_key_value_heads if extra_kv_heads is None else extra_kv_heads] * extra_attn_layers
    k = [torch.zeros(num_blocks, block_size, n, cfg.head_dim, dtype=dtype, device=device) for n in nkv]
    v = [torch.zeros(num_blocks, block_size, n, cfg.head_dim, dtype=dtype, device=device) for n in nkv]
    conv = ssm = None
    n_gdn = len(cfg.gdn_layer_ids)
    if n_gdn:
        conv = torch.zeros(n_gdn, num_slots + 1, cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim,
                           dtype=dtype, device=device)
        ssm = torch.zeros(n_gdn, num_slots + 1, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, dtype=torch.float32, device=device)
    return ModelCaches(k=k, v=v, conv=conv, ssm=ssm)


def num_checkpoint_slots_for(cfg) -> int:
    """State slots for prefix-cache checkpoints beside the running requests' (hybrid models with
    prefix caching on; default max_num_seqs: every running request can leave one behind)."""
    cc = cfg.cache
    if not cc.enable_prefix_caching or not cfg.model.is_hybrid:
        return 0
    return cc.num_checkpoint_slots if cc.num_checkpoint_slots is not None else cfg.scheduler.max_num_seqs


def prefix_cache_settings(cfg, dtype: torch.dtype, extra_attn_layers: int = 0) -> PrefixCacheSettings | None:
    """What the scheduler's prefix cache needs to know (None: prefix caching off)."""
    cc, mc = cfg.cache, cfg.model
    if not cc.enable_prefix_caching:
        return None
    n_attn = len(mc.attn_layer_ids) + extra_attn_layers
    return PrefixCacheSettings(checkpoint_interval=cc.checkpoint_interval, proposer_has_kv=extra_attn_layers > 0,
                               state_bytes=max(1, state_bytes_per_slot(mc, dtype)),
                               block_bytes=kv_bytes_per_block(mc, cc.block_size, dtype, n_attn))


class MemoryPlanError(ValueError):
    """The cache cannot be sized as asked; the message says which setting to change."""


def profile_activation_bytes(model: torch.nn.Module, cfg, dtype: torch.dtype, device: torch.device) -> int:
    """The profiling pass (CUDA): peak memory of one forward of max_num_batched_tokens dummy tokens
    (as prefills of at most max_model_len tokens) plus the LM head over the largest row count,
    above what is allocated before it, not counting the scratch caches it needs."""
    from backboard.forward_context import set_forward_context
    from backboard.worker.input_batch import BatchRequest, prepare_batch

    mc, sc, bs = cfg.model, cfg.scheduler, cfg.cache.block_size
    T = sc.max_num_batched_tokens
    lens = [min(T - i, sc.max_model_len) for i in range(0, T, sc.max_model_len)]
    per = [-(-n // bs) for n in lens]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    caches = allocate_caches(mc, sum(per), bs, len(lens), dtype, device)
    scratch = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    starts = np.cumsum([0] + per)
    reqs = [BatchRequest(np.zeros(n, dtype=np.int64), 0, list(range(starts[i], starts[i] + per[i])), i)
            for i, n in enumerate(lens)]
    pb = prepare_batch(reqs, bs, device)
    with torch.inference_mode(), set_forward_context(pb.meta, caches):
        h = model(pb.input_ids, pb.meta.positions)
        rows = min(h.shape[0], sc.max_num_seqs * (1 + cfg.num_spec_tokens))
        model.compute_logits(h[:rows]).softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - scratch
    del caches, h
    torch.cuda.empty_cache()
    return int(peak)


def plan_cache(cfg, dtype: torch.dtype, device: torch.device, extra_attn_layers: int = 0,
               activation_bytes: int | None = None, extra_kv_heads: int | None = None) -> tuple[int, int]:
    """(num_kv_blocks, num_state_slots) for an EngineConfig.

    Slots: max_num_seqs * (1 + k) unless set, plus the prefix cache's checkpoint slots on hybrid
    models (num_checkpoint_slots_for). Blocks: `num_kv_blocks` if set; on CUDA, what fits
    in gpu_memory_utilization of the card after the weights and the state slots (a profiling
    pass: the memory actually in use now, plus an activation reserve); on CPU, kv_cache_memory_gib
    (default 4 GiB), never more than max_num_seqs full-length sequences need.
    activation_bytes: the profiling pass's peak (profile_activation_bytes); None: an estimate.
    extra_kv_heads: the KV heads of the extra layers (None: the config's)."""
    mc, cc, sc = cfg.model, cfg.cache, cfg.scheduler
    bs = cc.block_size
    slots = (cc.num_state_slots or sc.max_num_seqs * (1 + cfg.num_spec_tokens)) + num_checkpoint_slots_for(cfg)
    per_block = max(1, kv_bytes_per_block(mc, bs, dtype)
                    + kv_bytes_per_block(mc, bs, dtype, extra_attn_layers, extra_kv_heads))
    blocks_per_seq = -(-(sc.max_model_len + spec_token_margin(cfg.num_spec_tokens)) // bs)
    useful = sc.max_num_seqs * blocks_per_seq + 1
    if cc.num_kv_blocks is not None:
        blocks = cc.num_kv_blocks
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        state = (slots + 1) * state_bytes_per_slot(mc, dtype)
        act = activation_bytes
        if act is None:   # a generous bound: hidden, MLP / GDN intermediates and logits rows
            act = sc.max_num_batched_tokens * (4 * mc.hidden_size + 2 * mc.intermediate_size) * 4 * 2
            act += sc.max_num_seqs * (1 + cfg.num_spec_tokens) * mc.vocab_size * 4 * 3
        budget = int(total * cc.gpu_memory_utilization) - (total - free) - state - act
        blocks = min(useful, budget // per_block)
    else:
        gib = cc.kv_cache_memory_gib if cc.kv_cache_memory_gib is not None else 4.0
        blocks = min(useful, int(gib * GiB) // per_block)
    if blocks * bs < sc.max_model_len:
        raise MemoryPlanError(
            f"the KV cache holds {max(blocks, 0)} blocks of {bs} tokens = {max(blocks, 0) * bs} tokens, "
            f"less than one sequence of max_model_len={sc.max_model_len}: lower --max-model-len or give "
            "the cache more memory (--num-kv-blocks / --kv-cache-memory-gib / --gpu-memory-utilization)")
    return int(blocks), int(slots)
