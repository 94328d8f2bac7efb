"""The Gated DeltaNet mixer over the flat batch.

The four input projections are one joined GEMM: [q | k | v] (the conv channels), z, b, a. The
short causal conv and the delta rule keep their state in slots: uniform groups (decodes, verify
rows) take the batched recurrent form, prefill spans the chunked form."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backboard.layers.linear import Linear
from backboard.layers.norm import GatedRMSNorm
from backboard.ops.conv1d import causal_conv1d_update, causal_conv1d_varlen
from backboard.ops.gdn import gdn_chunked_varlen, gdn_recurrent
from backboard.worker.forward_context import get_forward_context


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, nk: int, nv: int, dk: int, dv: int, conv_kernel: int,
                 eps: float, dtype: torch.dtype, gdn_idx: int) -> None:
        super().__init__()
        self.nk, self.nv, self.dk, self.dv = nk, nv, dk, dv
        self.key_dim, self.value_dim = nk * dk, nv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.gdn_idx = gdn_idx              # ordinal among the GDN layers (state index)
        self.in_proj = Linear(hidden, [self.conv_dim, self.value_dim, nv, nv], dtype)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel, dtype=dtype),
                                          requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(nv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(nv, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(dv, eps, dtype)
        self.out_proj = Linear(self.value_dim, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        ctx = get_forward_context()
        meta = ctx.meta
        conv_state, ssm_state = ctx.caches.conv[self.gdn_idx], ctx.caches.ssm[self.gdn_idx]
        T = x.shape[0]
        qkv, z, b, a = self.in_proj.split(self.in_proj(x))
        beta = b.float().sigmoid()                                                  # [T, nv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, nv]
        mixed = torch.empty_like(qkv)                                               # [T, C]
        core = torch.empty(T, self.nv, self.dv, dtype=torch.float32, device=x.device)
        for grp in meta.groups:
            ts, te, n, L = grp.tok_start, grp.tok_end, grp.num_reqs, grp.L
            src = meta.state_slots[grp.req_start:grp.req_end]
            dst = grp.dst_slots if grp.dst_slots is not None else src
            init = meta.has_initial_state[grp.req_start:grp.req_end]
            y = causal_conv1d_update(qkv[ts:te].view(n, L, -1), self.conv1d_weight, conv_state,
                                     src, dst, init)
            mixed[ts:te] = y.reshape(-1, self.conv_dim)
            q, k, v = self._split_heads(mixed[ts:te])
            core[ts:te] = gdn_recurrent(
                q.view(n, L, self.nk, self.dk), k.view(n, L, self.nk, self.dk),
                v.view(n, L, self.nv, self.dv), g[ts:te].view(n, L, -1), beta[ts:te].view(n, L, -1),
                ssm_state, src, dst, init).reshape(-1, self.nv, self.dv)
        if meta.num_prefills:
            ps = meta.prefill_tok_start
            cu = meta.prefill_cu_seqlens()
            slots = meta.state_slots[meta.prefill_start:].tolist()
            init = meta.has_initial_state_cpu[meta.prefill_start:].tolist()
            mixed[ps:] = causal_conv1d_varlen(qkv[ps:], self.conv1d_weight, conv_state, cu, slots, init)
            q, k, v = self._split_heads(mixed[ps:])
            core[ps:] = gdn_chunked_varlen(q, k, v, g[ps:], beta[ps:], ssm_state, cu, slots, init)
        o = self.norm(core.to(x.dtype), z.view(T, self.nv, self.dv))
        return self.out_proj(o.reshape(T, self.value_dim))

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(-1, self.nk, self.dk), k.reshape(-1, self.nk, self.dk),
                v.reshape(-1, self.nv, self.dv))
