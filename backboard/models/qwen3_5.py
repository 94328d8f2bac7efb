"""The Qwen hybrid decoder (Qwen3.5 / Qwen3.6, Qwen3-Next): Gated DeltaNet layers and gated
attention layers, SwiGLU (or mixture-of-experts) MLPs, zero-centred RMSNorm.

One forward takes the flat batch (all scheduled tokens of all requests concatenated) and returns
the final-normed hidden states of every token; `compute_logits` runs the LM head on the rows asked
for. Batch metadata and caches come from the forward context."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from backboard.config import ModelConfig
from backboard.distributed.parallel_state import tp_rank, tp_size
from backboard.distributed.shard import TensorSlice, head_range, scaled
from backboard.layers.attention import PagedAttention, QKNormRope
from backboard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from backboard.layers.gated_deltanet import GatedDeltaNet
from backboard.layers.linear import Linear
from backboard.layers.mlp import MLP, SparseMoE
from backboard.layers.norm import RMSNorm
from backboard.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from backboard.layers.rotary import RotaryEmbedding
from backboard.models.cpu_decode import CpuDecodeStep
from backboard.models.weights import WeightSpec


class GatedAttention(nn.Module):
    """q/k/v joined (with bias where cfg.qkv_bias); q_proj rows interleaved per head as
    [query D | gate D] when attn_output_gate; per-head q_norm / k_norm where cfg.qk_norm, partial
    RoPE, paged causal attention, out * sigmoid(gate), o_proj. The dense decoders (Qwen3, Qwen2,
    Llama) are this layer without the gate, and without q/k norm for Qwen2 and Llama.

    Under TP a rank keeps nh / tp query heads (with their gates) and nkv / tp KV heads, or one
    replicated KV head when they are fewer than the ranks; o_proj is row-parallel."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, attn_idx: int) -> None:
        super().__init__()
        D, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        hr, kvr = head_range(nh, tp_size(), tp_rank()), head_range(nkv, tp_size(), tp_rank())
        self.nh, self.nkv, self.D = hr[1] - hr[0], kvr[1] - kvr[0], D
        self.gated = cfg.attn_output_gate
        qD = D * (2 if self.gated else 1)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [nh * qD, nkv * D, nkv * D], dtype,
                                             bias=cfg.qkv_bias,
                                             part_ranges=[scaled(hr, qD), scaled(kvr, D), scaled(kvr, D)])
        self.o_proj = RowParallelLinear(nh * D, cfg.hidden_size, dtype, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.D, cfg.rms_norm_eps, dtype, cfg.norm_zero_centered)
            self.k_norm = RMSNorm(self.D, cfg.rms_norm_eps, dtype, cfg.norm_zero_centered)
        self.rotary = RotaryEmbedding(self.D, cfg.rotary_dim, cfg.rope_theta)
        self.attn = PagedAttention(self.nh, self.nkv, self.D, attn_idx)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: q / k norms (where the model has them) and RoPE run with the cache
        write (QKNormRope: one C++ / Triton op instead of ~20 torch ops per layer)."""
        q, k, v, gate = self._split(x)
        if self.qk_norm:
            pro = QKNormRope(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                             self.q_norm.zero_centered, self.rotary.inv_freq, positions)
        else:
            pro = QKNormRope(None, None, 0.0, False, self.rotary.inv_freq, positions)
        return self._output(self.attn(q, k, v, pro), gate)

    def forward_dense(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One whole sequence with plain causal attention and no cache (draft-head training)."""
        q, k, v, gate = self._project(x, positions)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            enable_gqa=self.nh != self.nkv)
        return self._output(o.transpose(0, 1), gate)

    def _split(self, x: torch.Tensor):
        """-> q [T, nh, D], k/v [T, nkv, D] (views of the joined projection, not normed),
        gate [T, nh, D] or None."""
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.gated:
            qg = q.view(T, self.nh, 2 * self.D)
            q, gate = qg[..., :self.D], qg[..., self.D:]
        else:
            q, gate = q.view(T, self.nh, self.D), None
        return q, k.view(T, self.nkv, self.D), v.view(T, self.nkv, self.D), gate

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """-> q [T, nh, D], k/v [T, nkv, D] (normed, rotated), gate [T, nh, D] or None."""
        q, k, v, gate = self._split(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        return q.contiguous(), k.contiguous(), v, gate

    def _output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        T = o.shape[0]
        o = o.reshape(T, self.nh * self.D)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(T, self.nh * self.D))
        return self.o_proj(o)

    def weight_specs(self, src: str, dst: str) -> dict[str, WeightSpec]:
        q_rows, kv, _ = self.qkv_proj.full_sizes
        H = self.qkv_proj.in_features
        slices = _part_slices(self.qkv_proj)
        specs = {f"{dst}.qkv_proj.weight": WeightSpec.cat(
            [(f"{src}.q_proj.weight", (q_rows, H)), (f"{src}.k_proj.weight", (kv, H)),
             (f"{src}.v_proj.weight", (kv, H))], slices)}
        if self.qkv_proj.bias is not None:
            specs[f"{dst}.qkv_proj.bias"] = WeightSpec.cat(
                [(f"{src}.q_proj.bias", (q_rows,)), (f"{src}.k_proj.bias", (kv,)), (f"{src}.v_proj.bias", (kv,))],
                slices)
        return specs


def _part_slices(lin: Linear) -> list[TensorSlice] | None:
    """Each part's rows this rank reads (None: whole tensors, TP = 1 or a replicated layer)."""
    if tp_size() == 1 or not isinstance(lin, ColumnParallelLinear):
        return None
    return [lin.part_slice(i) for i in range(len(lin.full_sizes))]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 attn_idx: int = -1, gdn_idx: int = -1, moe: bool | None = None) -> None:
        super().__init__()
        H, eps, zc = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_zero_centered
        self.is_gdn = cfg.layer_types[layer_idx] == "linear_attention"
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(
                H, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, eps, dtype, gdn_idx)
        else:
            self.self_attn = GatedAttention(cfg, dtype, attn_idx)
        moe = cfg.is_moe_layer(layer_idx) if moe is None else moe
        if moe:
            self.mlp: nn.Module = SparseMoE(H, cfg.num_experts, cfg.num_experts_per_tok,
                                            cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
                                            cfg.norm_topk_prob, dtype)
        else:
            self.mlp = MLP(H, cfg.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(H, eps, dtype, zc)
        self.post_attention_layernorm = RMSNorm(H, eps, dtype, zc)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (mlp output, residual): the residual add is fused into the next norm
        (x + residual is rounded to the model dtype first, exactly as `h = h + x`)."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        if self.is_gdn:
            x = self.linear_attn(x)
        else:
            x = (self.self_attn.forward_dense if dense else self.self_attn)(x, positions)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def layer_weight_specs(cfg: ModelConfig, layer: DecoderLayer, src: str, dst: str) -> dict[str, WeightSpec]:
    """Joined / reshaped weights of one decoder layer: HF names under `src`, ours under `dst`.
    Everything not listed maps one to one under the same relative name."""
    H = cfg.hidden_size
    specs: dict[str, WeightSpec] = {}
    if layer.is_gdn:
        specs.update(_gdn_specs(cfg, layer.linear_attn, f"{src}.linear_attn", f"{dst}.linear_attn"))
    else:
        specs.update(layer.self_attn.weight_specs(f"{src}.self_attn", f"{dst}.self_attn"))
    if isinstance(layer.mlp, SparseMoE):
        m = layer.mlp
        E, I = m.num_experts, m.inter
        s = f"{src}.mlp"
        specs[f"{dst}.mlp.w13"] = WeightSpec(
            [(f"{s}.experts.{e}.{p}.weight", (I, H)) for e in range(E) for p in ("gate_proj", "up_proj")],
            lambda ts, E=E: torch.stack([torch.cat(ts[2 * e:2 * e + 2]) for e in range(E)]))
        specs[f"{dst}.mlp.w2"] = WeightSpec(
            [(f"{s}.experts.{e}.down_proj.weight", (H, I)) for e in range(E)],
            lambda ts: torch.stack(ts))
        specs.update(_mlp_specs(m.shared_expert, f"{s}.shared_expert", f"{dst}.mlp.shared_expert"))
    else:
        specs.update(_mlp_specs(layer.mlp, f"{src}.mlp", f"{dst}.mlp"))
    return specs


def _mlp_specs(mlp: MLP, src: str, dst: str) -> dict[str, WeightSpec]:
    I, H = mlp.inter, mlp.gate_up_proj.in_features
    return {f"{dst}.gate_up_proj.weight": WeightSpec.cat(
        [(f"{src}.gate_proj.weight", (I, H)), (f"{src}.up_proj.weight", (I, H))], _part_slices(mlp.gate_up_proj))}


def _gdn_specs(cfg: ModelConfig, gdn: GatedDeltaNet, src: str, dst: str) -> dict[str, WeightSpec]:
    """Full shapes from cfg; under TP each source is read at this rank's heads only."""
    H, nk, nv, dk, dv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, gdn.dk, gdn.dv
    K, C, tp = cfg.linear_conv_kernel_dim, cfg.gdn_conv_dim, tp_size() > 1
    conv = gdn.conv_slice(nk) if tp else None
    specs = {f"{dst}.conv1d_weight": WeightSpec(
        [(f"{src}.conv1d.weight", (C, 1, K))], lambda ts: ts[0].reshape(ts[0].shape[0], -1), [conv]),
        f"{dst}.norm_weight": WeightSpec.same(f"{src}.norm.weight", (dv,))}
    if cfg.gdn_projection_layout == "split":
        p = _part_slices(gdn.in_proj)
        specs[f"{dst}.in_proj.weight"] = WeightSpec.cat(
            [(f"{src}.in_proj_qkv.weight", (C, H)), (f"{src}.in_proj_z.weight", (nv * dv, H)),
             (f"{src}.in_proj_b.weight", (nv, H)), (f"{src}.in_proj_a.weight", (nv, H))],
            [conv, p[3], p[4], p[5]] if p else None)
    else:
        r, kr = nv // nk, gdn.head_ranges[0]
        groups = [TensorSlice.rows(scaled(kr, 2 * dk + 2 * r * dv)), TensorSlice.rows(scaled(kr, 2 * r))]
        specs[f"{dst}.in_proj.weight"] = WeightSpec(
            [(f"{src}.in_proj_qkvz.weight", (nk * (2 * dk + 2 * r * dv), H)),
             (f"{src}.in_proj_ba.weight", (nk * 2 * r, H))],
            lambda ts, n=gdn.nk: _regroup_qkvz_ba(ts[0], ts[1], n, dk, r * dv, r), groups if tp else None)
    return specs


def _regroup_qkvz_ba(qkvz: torch.Tensor, ba: torch.Tensor, nk: int, dk: int, rdv: int,
                     r: int) -> torch.Tensor:
    """Qwen3-Next groups its projections per key head ([q k v z] per group, [b a] per group);
    reorder the rows into the flat [q | k | v | z | b | a] layout of the joined GEMM."""
    H = qkvz.shape[1]
    g = qkvz.view(nk, 2 * dk + 2 * rdv, H)
    q, k, v, z = torch.split(g, [dk, dk, rdv, rdv], dim=1)
    b, a = torch.split(ba.view(nk, 2 * r, H), [r, r], dim=1)
    return torch.cat([t.reshape(-1, H) for t in (q, k, v, z, b, a)])


class Qwen3_5ForCausalLM(nn.Module):
    """The text decoder of every supported checkpoint (qwen3 dense too: all layers attention,
    plain norms, no output gate; see models/qwen3.py)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        attn_ids, gdn_ids = cfg.attn_layer_ids, cfg.gdn_layer_ids
        self.layers = nn.ModuleList([
            DecoderLayer(cfg, i, dtype,
                         attn_idx=attn_ids.index(i) if i in attn_ids else -1,
                         gdn_idx=gdn_ids.index(i) if i in gdn_ids else -1)
            for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_zero_centered)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype,
                              tied=self.embed_tokens if cfg.tie_word_embeddings else None)
        self.cpu_decode = CpuDecodeStep(self)      # decode-only steps on the CPU (models/cpu_decode.py)

    @property
    def num_attn_layers(self) -> int:
        return len(self.cfg.attn_layer_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, H]."""
        if input_ids.is_cpu and (h := self.cpu_decode.forward(input_ids, positions, inputs_embeds)) is not None:
            return h
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, positions)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] (only the rows that need logits) -> fp32 logits [R, V]."""
        return self.lm_head(hidden)

    # ---- weights ---------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, WeightSpec]:
        specs: dict[str, WeightSpec] = {}
        for i, layer in enumerate(self.layers):
            specs.update(layer_weight_specs(self.cfg, layer, f"model.layers.{i}", f"layers.{i}"))
        return specs

    def checkpoint_name(self, param: str) -> str:
        """Our parameter name -> the checkpoint's (after prefix normalisation)."""
        if param.startswith("lm_head."):
            return param
        return "model." + param

    def ignored_checkpoint_keys(self) -> Callable[[str], bool]:
        tied = self.cfg.tie_word_embeddings
        return lambda k: k.startswith("mtp.") or (tied and k == "lm_head.weight")
