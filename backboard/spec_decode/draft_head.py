"""Our draft head: the MTP structure with 4-bit group-quantized weights (fp32 accumulation) and an
INT8 LM head (per-channel scales) used only for drafting.

Saved format (a folder, loaded with `{"method": "draft_head", "draft_model": DIR}`):

    config.json                 {"format": "backboard-draft-head", "version": 1,
                                 "hidden_size", "vocab_size", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "intermediate_size",
                                 "group_sizes": {layer name: G}, "int8_lm_head": bool,
                                 "base_model": path it was made from, "source": "train" | "mtp",
                                 "stats": {...}}
    draft_head.safetensors      for each linear layer NAME (e.g. "fc", "layers.0.self_attn.qkv_proj",
                                 "layers.0.mlp.gate_up_proj"): NAME.qweight uint8 [out, in/2] and
                                 NAME.scales fp32 [out, in/G] (ops/quant.py's int4 format);
                                 norms in full precision under their parameter names;
                                 lm_head.qweight int8 [V', hidden], lm_head.scales fp32 [V']
                                 when int8_lm_head; lm_head.token_ids int64 [V'] when it drafts
                                 over a draft vocabulary ("draft_vocab_size": V' in config.json;
                                 spec_decode/draft_vocab.py), else V' is the whole vocabulary.
The embedding is the target model's (shared, not saved)."""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np
import torch
from torch import nn

from backboard.config import ConfigError, ModelConfig
from backboard.distributed.parallel_state import all_gather_last, replicated, tp_rank, tp_size
from backboard.distributed.shard import VocabShard, pad_rows
from backboard.layers.linear import Int4Linear, Int8Linear, Linear
from backboard.models.mtp import MTPHead
from backboard.models.weight_arena import pack_weights
from backboard.ops import dispatch
from backboard.spec_decode.draft_vocab import DraftLMHead

FORMAT = "backboard-draft-head"


def _group_for(in_features: int, group_size: int) -> int:
    for g in (group_size, 128, 64, 32):
        if g <= group_size and in_features % g == 0 and g % 32 == 0:
            return g
    raise ValueError(f"no int4 group size (a multiple of 32 <= {group_size}) divides {in_features}")


def _linears(head: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in head.named_modules() if isinstance(m, (Linear, Int4Linear))]


def _set(module: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, new)


def quantize_head(head: MTPHead, group_size: int = 64) -> dict[str, int]:
    """Replace every linear layer of the head with its int4 form, in place. Returns the group
    size chosen per layer."""
    if any("experts" in n for n, _ in head.named_parameters()):
        raise ValueError("draft heads with mixture-of-experts MLPs are not supported")
    groups = {}
    for name, lin in _linears(head):
        g = _group_for(lin.in_features, group_size)
        _set(head, name, Int4Linear.from_linear(lin, g))
        groups[name] = g
    return groups


class _FakeQuantInt4(nn.Module):
    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        from backboard.ops.quant import fake_quant_int4

        return fake_quant_int4(w, self.group_size)


def fake_quantize_head(head: MTPHead, group_size: int = 64, on: bool = True) -> None:
    """Quantization-aware training: every linear layer's weight reads as its int4 values (the
    ones quantize_head will store, same group sizes) with straight-through gradients to the float
    weights (on=True); on=False takes that off again, keeping the float weights."""
    from torch.nn.utils import parametrize

    for _, lin in _linears(head):
        if on and not parametrize.is_parametrized(lin, "weight"):
            parametrize.register_parametrization(lin, "weight", _FakeQuantInt4(_group_for(lin.in_features, group_size)))
        elif not on and parametrize.is_parametrized(lin, "weight"):
            parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)


def save_draft_head(out_dir: str, head: MTPHead, groups: dict[str, int], cfg: ModelConfig,
                    lm_head_weight: torch.Tensor | None, source: str, stats: dict | None = None,
                    draft_vocab: np.ndarray | None = None) -> None:
    """Write the folder; lm_head_weight [V, H] (the target's, whole) becomes the INT8 LM head,
    only its draft_vocab rows ([V'] sorted ids) when given."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if lm_head_weight is not None:
        sd.update(_lm_head_tensors(lm_head_weight, draft_vocab))
    save_file(sd, os.path.join(out_dir, "draft_head.safetensors"), metadata={"format": FORMAT})
    meta = {"format": FORMAT, "version": 1, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "group_sizes": groups,
            "int8_lm_head": lm_head_weight is not None, "base_model": os.path.abspath(cfg.path),
            "source": source, "stats": stats or {}}
    if lm_head_weight is not None and draft_vocab is not None:
        meta["draft_vocab_size"] = len(draft_vocab)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(meta, f, indent=2)


def _lm_head_tensors(lm_head_weight: torch.Tensor, draft_vocab: np.ndarray | None) -> dict[str, torch.Tensor]:
    w = lm_head_weight.detach().float().cpu()
    ids = None if draft_vocab is None else torch.from_numpy(np.asarray(draft_vocab, dtype=np.int64))
    lm = Int8Linear.from_weight(w if ids is None else w[ids])
    out = {"lm_head.qweight": lm.qweight, "lm_head.scales": lm.scales}
    return out if ids is None else {**out, "lm_head.token_ids": ids.contiguous()}


def set_draft_vocab(path: str, lm_head_weight: torch.Tensor, draft_vocab: np.ndarray | None,
                    stats: dict | None = None) -> None:
    """Rewrite a saved head's INT8 LM head over draft_vocab ([V'] sorted ids; None: the whole
    vocabulary) from the target's lm_head_weight [V, H]; stats are merged into its config's."""
    from safetensors.torch import load_file, save_file

    st = os.path.join(path, "draft_head.safetensors")
    sd = {k: v for k, v in load_file(st).items() if not k.startswith("lm_head.")}
    save_file({**sd, **_lm_head_tensors(lm_head_weight, draft_vocab)}, st, metadata={"format": FORMAT})
    with open(os.path.join(path, "config.json")) as f:
        meta = json.load(f)
    meta["int8_lm_head"] = True
    meta.pop("draft_vocab_size", None)
    if draft_vocab is not None:
        meta["draft_vocab_size"] = len(draft_vocab)
    meta["stats"] = {**meta.get("stats", {}), **(stats or {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(meta, f, indent=2)


def read_draft_config(path: str, mc: ModelConfig) -> dict:
    cfg_path = os.path.join(path or "", "config.json")
    if not path or not os.path.isfile(cfg_path):
        raise ConfigError(f"draft head folder {path!r} has no config.json: create one with "
                          "`backboard draft train` or `backboard draft quantize`")
    with open(cfg_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{cfg_path} is not a Backboard draft head (format {meta.get('format')!r})")
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if meta.get(key) != getattr(mc, key):
            raise ConfigError(f"draft head {path} was made for {key}={meta.get(key)}, the model has "
                              f"{getattr(mc, key)}: train it for this model")
    return meta


def read_draft_head(path: str, mc: ModelConfig, dtype: torch.dtype, attn_idx: int,
                    device: str = "cpu") -> tuple[MTPHead, dict[str, torch.Tensor]]:
    """The saved head with its int4 layers as saved (eval mode) and its INT8 LM head's tensors
    ({"qweight", "scales"}, empty when it has none)."""
    from safetensors.torch import load_file

    meta = read_draft_config(path, mc)
    with torch.device(device), replicated():
        head = MTPHead(mc, dtype, attn_idx)
    groups = meta["group_sizes"]
    for name, lin in _linears(head):
        if name not in groups:
            raise ConfigError(f"draft head {path} lacks layer {name}")
        _set(head, name, Int4Linear(lin.in_features, lin.output_sizes, groups[name]))
    sd = load_file(os.path.join(path, "draft_head.safetensors"), device=device)
    lm_sd = {k[len("lm_head."):]: sd.pop(k) for k in list(sd) if k.startswith("lm_head.")}
    missing, unexpected = head.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ConfigError(f"draft head {path} does not match its config: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    return head.eval(), lm_sd


def widen_head(head: MTPHead, dtype: torch.dtype) -> None:
    """Every int4 layer of the head as a dense Linear in dtype, in place (Int4Linear.widened)."""
    for name, lin in _linears(head):
        if isinstance(lin, Int4Linear):
            _set(head, name, lin.widened(dtype))


def load_draft_head(path: str, mc: ModelConfig, dtype: torch.dtype, lm_head_weight: torch.Tensor,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor], attn_idx: int, device: str,
                    int8_lm_head: bool = True) -> tuple[MTPHead, DraftLMHead]:
    """The head (in the target's dtype) and the LM head it drafts with (DraftLMHead: hidden [R, H]
    -> token ids [R]): its saved INT8 LM head (over its draft vocabulary when it has one), or one
    quantized from the target's (lm_head_weight [V / tp padded, H]: this rank's rows), or the
    target's own compute_logits without int8_lm_head. With it, a bf16 target's bf16 LM head (its
    draft-vocabulary rows) still takes the rows above dispatch.int8_lm_head_rows_max (CPUs where
    bf16 is the faster LM head there). For a bf16 target on CPUs where dispatch.int4_widened_pays,
    the int4 layers are widened to bf16 once here (each int4 value times its scale, rounded to
    bf16; drafts only, so speculation stays lossless).

    Under TP the head is whole on every rank (built in parallel_state.replicated(); it is small,
    and every rank has the whole hidden state after the row-parallel all-reduce), so its attention
    layer needs a KV cache with all the KV heads; the INT8 LM head is split by vocabulary as the
    target's is, or whole on every rank over a draft vocabulary (no collective: the same drafts)."""
    head, lm_sd = read_draft_head(path, mc, dtype, attn_idx, device)
    if dtype == torch.bfloat16 and dispatch.int4_widened_pays(torch.device(device)):
        widen_head(head, dtype)
    if torch.device(device).type == "cpu":
        pack_weights(head)                  # one buffer in forward order, as the target's
    if not int8_lm_head:
        return head, DraftLMHead(compute_logits)
    rows_max = dispatch.int8_lm_head_rows_max(torch.device(device)) if dtype == torch.bfloat16 else None
    if "token_ids" in lm_sd:
        return head, _draft_vocab_lm_head(lm_sd, lm_head_weight, rows_max, device)
    int8 = _int8_lm_head(lm_sd, lm_head_weight, mc.vocab_size, device)
    return head, DraftLMHead(int8, compute_logits, rows_max)


def _draft_vocab_lm_head(lm_sd: dict[str, torch.Tensor], lm_head_weight: torch.Tensor, rows_max: int | None,
                         device: str) -> DraftLMHead:
    """The saved INT8 rows of the draft vocabulary, whole on every rank; with one rank, above
    rows_max rows the target's bf16 rows of the same tokens, and the context tokens outside the
    vocabulary from the target's rows (lm_head_weight [V, H]; under TP a rank has only its share:
    the draft vocabulary alone)."""
    ids = lm_sd["token_ids"].to(device)
    lm = Int8Linear(lm_sd["qweight"].shape[1], len(ids))
    lm.qweight, lm.scales = lm_sd["qweight"], lm_sd["scales"]
    lm = lm.to(device)
    if tp_size() > 1:
        return DraftLMHead(lm, token_ids=ids)
    if rows_max is None:
        return DraftLMHead(lm, token_ids=ids, rows=lm_head_weight)
    w = lm_head_weight[ids].contiguous()
    return DraftLMHead(lm, lambda h: dispatch.linear(h, w, out_dtype=torch.float32), rows_max, ids, lm_head_weight)


def _int8_lm_head(lm_sd: dict[str, torch.Tensor], lm_head_weight: torch.Tensor, vocab_size: int,
                  device: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """This rank's vocabulary rows of the INT8 LM head (the saved one's, or the target's rows
    quantized: per-channel scales make them the rows of the whole head's quantization), logits
    gathered over the ranks. hidden [R, H] -> fp32 logits [R, V]."""
    s = VocabShard.of(vocab_size, tp_size(), tp_rank())
    if lm_sd:
        lm = Int8Linear(lm_sd["qweight"].shape[1], s.padded)
        pad = s.padded - (s.end - s.start)
        lm.qweight, lm.scales = (pad_rows(lm_sd[n][s.start:s.end], pad) for n in ("qweight", "scales"))
    else:
        lm = Int8Linear.from_weight(lm_head_weight)
    lm = lm.to(device)
    if tp_size() == 1:
        return lm
    return lambda h: all_gather_last(lm(h))[:, :vocab_size]
