"""The kernel path: the model's layer sequence through backboard.ops.dispatch."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from backboard.forward_context import get_forward_context
from backboard.models.qwen3_5 import Qwen3_5ForCausalLM
from backboard.ops import dispatch as D
from backboard.ops.attention import paged_attention_prefill_ref as paged_attention_prefill


# ==== the kernel path: the model's layer sequence through backboard.ops.dispatch ===============
class KernelPath:
    """The decoder forward of Qwen3_5ForCausalLM with every op that has a kernel called through
    dispatch: fused residual-add + RMSNorm, the attention prologue (q / k norms + RoPE + cache
    write), the fused GDN decode step, the GDN prefill path, paged decode attention, SiLU-mul.
    Projections go through F.linear; prefill attention stays on the torch ops (SDPA)."""

    def __init__(self, model: Qwen3_5ForCausalLM) -> None:
        self.m = model
        self.cfg = model.cfg
        self.eps = model.cfg.rms_norm_eps
        self.zc = model.cfg.norm_zero_centered

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m, eps, zc = self.m, self.eps, self.zc
        h = m.embed_tokens(input_ids)                                      # [T, H]
        layers = list(m.layers)
        residual = h
        x = D.rms_norm(h, layers[0].input_layernorm.weight, eps, zc)
        for i, layer in enumerate(layers):
            mix = self.gdn(layer.linear_attn, x) if layer.is_gdn else self.attn(layer.self_attn, x, positions)
            x, residual = D.fused_add_rms_norm(mix, residual, layer.post_attention_layernorm.weight, eps, zc)
            y = self.mlp(layer.mlp, x)
            nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else m.norm.weight
            x, residual = D.fused_add_rms_norm(y, residual, nxt, eps, zc)
        return x                                                           # = norm(h_final)

    def mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        return F.linear(D.silu_mul(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)

    def gdn(self, mod, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        meta = ctx.meta
        conv_state, ssm_state = ctx.caches.conv[mod.gdn_idx], ctx.caches.ssm[mod.gdn_idx]
        T = x.shape[0]
        proj = F.linear(x, mod.in_proj.weight)                             # [T, C + vd + 2 nv]
        kw = dict(num_k_heads=mod.nk, num_v_heads=mod.nv, head_k_dim=mod.dk, head_v_dim=mod.dv,
                  eps=mod.eps)
        parts = []
        for grp in meta.groups:
            src = meta.state_slots[grp.req_start:grp.req_end]
            dst = grp.dst_slots if grp.dst_slots is not None else src
            init = meta.has_initial_state[grp.req_start:grp.req_end]
            parts.append(D.gdn_decode(proj[grp.tok_start:grp.tok_end], mod.conv1d_weight, conv_state,
                                      mod.A_log, mod.dt_bias, mod.norm_weight, ssm_state, src, dst,
                                      init, **kw))
        if meta.num_prefills:
            parts.append(mod._prefill(proj[meta.prefill_tok_start:], conv_state, ssm_state, meta))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        assert out.shape[0] == T
        return F.linear(out, mod.out_proj.weight)

    def attn(self, mod, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        meta = ctx.meta
        pa = mod.attn
        k_cache, v_cache = ctx.caches.k[pa.attn_idx], ctx.caches.v[pa.attn_idx]
        T, nh, nkv, Dh = x.shape[0], mod.nh, mod.nkv, mod.D
        q, k, v = mod.qkv_proj.split(F.linear(x, mod.qkv_proj.weight))
        if mod.gated:
            qg = q.view(T, nh, 2 * Dh)
            q, gate = qg[..., :Dh], qg[..., Dh:]
        else:
            q, gate = q.view(T, nh, Dh), None
        q = D.qk_norm_rope_write_kv(q, k.view(T, nkv, Dh), v.view(T, nkv, Dh), mod.q_norm.weight,
                                    mod.k_norm.weight, self.eps, self.zc, positions,
                                    mod.rotary.inv_freq, k_cache, v_cache, meta.slot_mapping)
        parts = []
        for g in meta.groups:
            rs, re = g.req_start, g.req_end
            qg_ = q[g.tok_start:g.tok_end].view(g.num_reqs, g.L, nh, Dh)
            max_len = int(meta.seq_lens_cpu[rs:re].max())
            o = D.paged_attention_decode(qg_, k_cache, v_cache, meta.block_table[rs:re],
                                         meta.seq_lens[rs:re], max_len, pa.scale)
            parts.append(o.reshape(-1, nh, Dh))
        qsl = meta.query_start_loc_cpu
        for r in range(meta.prefill_start, meta.num_reqs):
            s, e = int(qsl[r]), int(qsl[r + 1])
            parts.append(paged_attention_prefill(q[s:e], k_cache, v_cache, meta.block_table[r],
                                                 int(meta.seq_lens_cpu[r]), pa.scale))
        o = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(T, nh * Dh)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(T, nh * Dh))
        return F.linear(o, mod.o_proj.weight)


def layers_wired() -> bool:
    """Whether the model's layers already call backboard.ops.dispatch."""
    import backboard.layers.attention as la
    import backboard.layers.gated_deltanet as lg
    import backboard.layers.mlp as lm
    import backboard.layers.norm as ln
    return any("dispatch" in inspect.getsource(mod) for mod in (la, lg, lm, ln))
