"""The Gated DeltaNet mixer over the flat batch.

The four input projections are one joined GEMM: [q | k | v] (the conv channels), z, b, a. The
short causal conv and the delta rule keep their state in slots: uniform groups (decodes, verify
rows) take the fused decode op (a Triton kernel on the GPU, its torch reference elsewhere),
prefill spans the chunked form (ops.dispatch.gdn_prefill).

Under TP a rank keeps an equal share of the key heads and of the value heads (value head j still
belongs to key head j // (nv / nk)): its rows of q, k, v, z, b, a, of the conv channels, A_log
and dt_bias, and its conv and recurrent states; out_proj is row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from backboard.distributed.parallel_state import tp_rank, tp_size
from backboard.distributed.shard import TensorSlice, even_range, scaled, set_shard
from backboard.forward_context import get_forward_context
from backboard.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from backboard.layers.rows import join_rows
from backboard.layers.state_snapshots import prefill_with_snapshots
from backboard.ops import dispatch


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, nk: int, nv: int, dk: int, dv: int, conv_kernel: int,
                 eps: float, dtype: torch.dtype, gdn_idx: int) -> None:
        super().__init__()
        kr, vr = even_range(nk, tp_size(), tp_rank()), even_range(nv, tp_size(), tp_rank())
        self.head_ranges = kr, vr           # this rank's key heads and value heads
        self.nk, self.nv, self.dk, self.dv, self.eps = kr[1] - kr[0], vr[1] - vr[0], dk, dv, eps
        self.key_dim, self.value_dim = self.nk * dk, self.nv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.gdn_idx = gdn_idx              # ordinal among the GDN layers (state index)
        Kd, Vd = nk * dk, nv * dv
        self.in_proj = ColumnParallelLinear(     # [q | k | v | z | b | a], this rank's heads of each
            hidden, [Kd, Kd, Vd, Vd, nv, nv], dtype,
            part_ranges=[scaled(kr, dk), scaled(kr, dk), scaled(vr, dv), scaled(vr, dv), vr, vr])
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel, dtype=dtype),
                                          requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.nv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv, dtype=dtype), requires_grad=False)
        if tp_size() > 1:
            set_shard(self.A_log, (nv,), TensorSlice.rows(vr))
            set_shard(self.dt_bias, (nv,), TensorSlice.rows(vr))
        self.norm_weight = nn.Parameter(torch.empty(dv, dtype=dtype), requires_grad=False)
        self.out_proj = RowParallelLinear(Vd, hidden, dtype)

    def conv_slice(self, full_nk: int) -> TensorSlice:
        """This rank's conv channels ([q | k | v] rows) in a tensor of all of them."""
        (kr, vr), dk, dv = self.head_ranges, self.dk, self.dv
        Kd = full_nk * dk
        return TensorSlice.rows(scaled(kr, dk), scaled(kr, dk, Kd), scaled(vr, dv, 2 * Kd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        ctx = get_forward_context()
        meta = ctx.meta
        conv_state, ssm_state = ctx.caches.conv[self.gdn_idx], ctx.caches.ssm[self.gdn_idx]
        T = x.shape[0]
        proj = self.in_proj(x)                                           # [T, C + nv*dv + 2nv]
        parts = []                          # outputs in token order (groups, then prefills)
        for grp in meta.groups:
            ts, te, rs, re = grp.tok_start, grp.tok_end, grp.req_start, grp.req_end
            src = meta.state_slots[rs:re]
            # None: every request continues from its state (the usual decode), nothing to zero
            init = None if meta.has_initial_state_cpu[rs:re].all() else meta.has_initial_state[rs:re]
            parts.append((ts, dispatch.gdn_decode(
                proj[ts:te], self.conv1d_weight, conv_state, self.A_log, self.dt_bias,
                self.norm_weight, ssm_state, src, grp.dst_slots if grp.dst_slots is not None else src,
                init, num_k_heads=self.nk, num_v_heads=self.nv, head_k_dim=self.dk,
                head_v_dim=self.dv, eps=self.eps)))
        if meta.num_prefills:
            ps = meta.prefill_tok_start
            parts.append((ps, self._prefill(proj[ps:], conv_state, ssm_state, meta)))
        return self.out_proj(join_rows(parts, T))

    def _prefill(self, proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                 meta) -> torch.Tensor:
        """Prefill spans (the chunked form), with the state snapshots the step takes inside them
        (layers/state_snapshots.py). proj [P, ...] -> [P, nv*dv]."""
        def run(rows: torch.Tensor, cu_seqlens: list[int], slots: torch.Tensor,
                has_initial_state: torch.Tensor) -> torch.Tensor:
            return dispatch.gdn_prefill(
                rows, self.conv1d_weight, conv_state, self.A_log, self.dt_bias, self.norm_weight,
                ssm_state, cu_seqlens, slots, has_initial_state, num_k_heads=self.nk,
                num_v_heads=self.nv, head_k_dim=self.dk, head_v_dim=self.dv, eps=self.eps)

        ps = meta.prefill_start
        slots, init = meta.state_slots[ps:], meta.has_initial_state[ps:]
        if not meta.state_snapshots:
            return run(proj, meta.prefill_cu_seqlens(), slots, init)
        return prefill_with_snapshots(run, proj, meta.prefill_cu_seqlens(), slots, init,
                                      meta.state_snapshots, (conv_state, ssm_state))
