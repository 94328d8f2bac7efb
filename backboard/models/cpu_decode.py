"""A decode step of the Qwen hybrid on the CPU as one flat loop of C++ kernel calls.

Where every request of a step decodes one token, the model's forward is a fixed sequence of
kernels: per GDN layer norm, in_proj, gdn_decode, out_proj, norm, gate_up, silu_mul, down; per
attention layer the same around qkv_proj, qk_norm_rope_write_kv, paged_attention_decode and the
output gate. Run through the modules, each call also pays nn.Module dispatch, ops/dispatch.py's
per-call checks and views: on 2 Zen 3 cores (AVX2) a one-request step of the benchmark checkpoint
(8 layers, 248K vocabulary) took 18.0 ms of which its C++ calls took 13.8, and a tiny model's step
(hidden 64) 1.8-1.9 ms. This loop calls the same kernels with the same arguments, deciding the
kernel choices once per step (the logits and states are bit-identical:
tests/ops/test_cpu_decode_step.py): there, 15.8 -> 13.8 ms (median of 12 interleaved pairs,
bench checkpoint), 1.90 -> 0.69 ms (tiny model), and for SmolLM2-135M (30 Llama layers, bf16)
22.6 -> 16.0 ms at one request, 34.4 -> 27.6 at four.

It covers the hybrid's GDN and gated attention layers and the dense decoders' plain attention
(with or without q / k norm: Llama, Qwen3). It is the CPU's counterpart of the CUDA graph runner:
the module path stays the definition, and runs whatever this does not cover (prefills, verify
groups, TP > 1, MoE, biases, weights other than bf16, the torch references or Triton kernels,
autograd).

    step = CpuDecodeStep(model)           # model: Qwen3_5ForCausalLM (or the dense Qwen3ForCausalLM)
    h = step.forward(input_ids, positions) # [T, H] final-normed, or None: run the modules
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from backboard.distributed.parallel_state import tp_size
from backboard.forward_context import ForwardMeta, get_forward_context
from backboard.layers.linear import Linear
from backboard.layers.mlp import MLP
from backboard.layers.norm import RMSNorm
from backboard.ops import dispatch
from backboard.ops.cpu import gemm as cpu_gemm


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    eps: float
    zero_centered: bool

    @staticmethod
    def of(m: RMSNorm) -> "_Norm":
        return _Norm(m.weight, m.eps, m.zero_centered)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parameters (the Parameter objects: loading into them in place is seen)."""

    is_gdn: bool
    mixer: nn.Module                  # GatedDeltaNet or GatedAttention (read for sizes only)
    norms: tuple[_Norm, _Norm]        # input, post-attention
    w_in: torch.Tensor                # in_proj / qkv_proj
    w_out: torch.Tensor               # out_proj / o_proj
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    qk_norms: tuple[_Norm, _Norm] | None = None   # attention's q / k norms (None: RoPE alone)
    gdn_params: tuple[torch.Tensor, ...] = ()     # conv1d_weight, A_log, dt_bias, norm_weight


_NO_NORM = _Norm(None, 0.0, False)         # RoPE without q / k norm (as QKNormRope(None, None, 0.0, False))


def decode_only(meta: ForwardMeta) -> bool:
    """One uniform group of one-token requests and nothing else."""
    g = meta.groups
    return meta.num_prefills == 0 and len(g) == 1 and g[0].L == 1 and not meta.state_snapshots


class CpuDecodeStep:
    """The flat decode loop of one model (Qwen3_5ForCausalLM: embed_tokens, layers, norm); whether
    its layers are covered is decided at the first decode step, once the weights are loaded."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.enabled = True               # False: always the module path (tests compare the two)
        self._layers: list[_Layer] | None = None
        self._eligible: bool | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """input_ids, positions [T] -> final-normed hidden states [T, H], or None where the module
        path must run this step."""
        ctx = get_forward_context()
        if not self.enabled or not decode_only(ctx.meta) or not self.eligible() or not _bf16_caches(ctx.caches):
            return None
        m = self.model
        w = self._layers[0].w_in
        kernels = dispatch.cpu_decode_kernels(w if inputs_embeds is None else inputs_embeds, w)
        if kernels is None:
            return None
        h = m.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        lin = cpu_gemm.decode_linear(h.shape[0], kernels[0])
        h, residual = _Loop(lin, kernels[1], ctx.meta, ctx.caches, positions).run(self._layers, h)
        return m.norm(h, residual)[0]

    def eligible(self) -> bool:
        """Whether every layer is one the loop covers (decided once, after the weights loaded)."""
        if self._eligible is None:
            self._eligible = tp_size() == 1 and all(_covered(layer) for layer in self.model.layers) \
                and self.model.norm.weight.dtype == torch.bfloat16
            if self._eligible:
                self._layers = [_plan(layer) for layer in self.model.layers]
        return self._eligible


def _bf16_caches(caches) -> bool:
    return all(t is None or t.dtype == torch.bfloat16 for t in (caches.conv, *caches.k[:1], *caches.v[:1]))


def _covered(layer: nn.Module) -> bool:
    """Dense SwiGLU MLP, attention with or without the output gate and q / k norms, and every weight
    bf16 (biases none): the dtypes under which the module path's ops/dispatch.py picks these same
    kernels."""
    if not isinstance(layer.mlp, MLP):
        return False
    mixer = layer.linear_attn if layer.is_gdn else layer.self_attn
    if not layer.is_gdn and mixer.rotary.inv_freq.dtype != torch.float32:
        return False
    linears = [m for m in (*mixer.children(), *layer.mlp.children()) if isinstance(m, Linear)]
    if len(linears) != 4 or any(m.bias is not None for m in linears):
        return False
    return all(p.dtype == torch.bfloat16 for n, p in layer.named_parameters() if not n.endswith("A_log"))


def _plan(layer: nn.Module) -> _Layer:
    norms = (_Norm.of(layer.input_layernorm), _Norm.of(layer.post_attention_layernorm))
    mlp = layer.mlp
    if layer.is_gdn:
        a = layer.linear_attn
        return _Layer(True, a, norms, a.in_proj.weight, a.out_proj.weight, mlp.gate_up_proj.weight,
                      mlp.down_proj.weight, gdn_params=(a.conv1d_weight, a.A_log, a.dt_bias, a.norm_weight))
    a = layer.self_attn
    return _Layer(False, a, norms, a.qkv_proj.weight, a.o_proj.weight, mlp.gate_up_proj.weight,
                  mlp.down_proj.weight, (_Norm.of(a.q_norm), _Norm.of(a.k_norm)) if a.qk_norm else None)


class _Loop:
    """One step's calls. lin(x, w): the step's GEMM; ops: the decode-ops module."""

    def __init__(self, lin: Callable, ops, meta: ForwardMeta, caches, positions: torch.Tensor) -> None:
        self.lin, self.ops, self.meta, self.caches, self.positions = lin, ops, meta, caches, positions
        g = meta.groups[0]
        self.src = meta.state_slots
        self.dst = g.dst_slots if g.dst_slots is not None else self.src
        # None: every request continues from its state (the usual decode), nothing to zero
        self.init = None if meta.has_initial_state_cpu.all() else meta.has_initial_state
        self.max_len = int(meta.seq_lens_cpu.max())

    def run(self, layers: list[_Layer], h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (embeddings) -> (last layer's MLP output, residual)."""
        ops, lin, residual = self.ops, self.lin, None
        for L in layers:
            n1, n2 = L.norms
            if residual is None:
                residual, x = h, ops.rms_norm(h, n1.weight, n1.eps, n1.zero_centered)
            else:
                x, residual = ops.fused_add_rms_norm(h, residual, n1.weight, n1.eps, n1.zero_centered)
            h = lin(self.gdn(L, lin(x, L.w_in)) if L.is_gdn else self.attention(L, lin(x, L.w_in)), L.w_out)
            x, residual = ops.fused_add_rms_norm(h, residual, n2.weight, n2.eps, n2.zero_centered)
            h = lin(ops.silu_mul(lin(x, L.w_gate_up)), L.w_down)
        return h, residual

    def gdn(self, L: _Layer, proj: torch.Tensor) -> torch.Tensor:
        """proj [T, C + nv*dv + 2nv] -> [T, nv*dv] (GatedDeltaNet.forward's decode group)."""
        a, i = L.mixer, L.mixer.gdn_idx
        conv_w, A_log, dt_bias, norm_w = L.gdn_params
        return self.ops.gdn_decode(proj, conv_w, self.caches.conv[i], A_log, dt_bias, norm_w, self.caches.ssm[i],
                                   self.src, self.dst, self.init, a.nk, a.nv, a.dk, a.dv, a.eps)

    def attention(self, L: _Layer, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, nh*qD + 2*nkv*D] (qD = 2D with the output gate) -> [T, nh*D], gated where the
        model gates (GatedAttention.forward, PagedAttention.forward's decode group)."""
        a, T, meta = L.mixer, qkv.shape[0], self.meta
        nh, nkv, D = a.nh, a.nkv, a.D
        q, k, v = a.qkv_proj.split(qkv)
        gate = None
        if a.gated:
            qg = q.view(T, nh, 2 * D)
            q, gate = qg[..., :D], qg[..., D:]
        else:
            q = q.view(T, nh, D)
        kc, vc = self.caches.k[a.attn.attn_idx], self.caches.v[a.attn.attn_idx]
        qn, kn = L.qk_norms or (_NO_NORM, _NO_NORM)
        q = self.ops.qk_norm_rope_write_kv(q, k.view(T, nkv, D), v.view(T, nkv, D), qn.weight, kn.weight, qn.eps,
                                           qn.zero_centered, self.positions, a.rotary.inv_freq, kc, vc,
                                           meta.slot_mapping)
        o = self.ops.paged_attention_decode(q.view(T, 1, nh, D), kc, vc, meta.block_table, meta.seq_lens,
                                            self.max_len, a.attn.scale).reshape(T, nh * D)
        return o if gate is None else o * torch.sigmoid(gate.reshape(T, nh * D))
