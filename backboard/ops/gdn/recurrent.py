"""Batched recurrent gated delta rule: B sequences, L tokens each, states read and written by slot.

L = 1 is the decode step. L = 1 + k with `dst_slots` of shape [B, L] is speculative verification:
the state after each position is written to its own slot, so the next step can start from the
last accepted one without a copy."""

from __future__ import annotations

import torch

from backboard.ops.gdn.reference import prepare_qk


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor, src_slots: torch.Tensor,
                  dst_slots: torch.Tensor, has_initial_state: torch.Tensor | None = None,
                  ) -> torch.Tensor:
    """q, k: [B, L, nk, dk]; v: [B, L, nv, dv]; g, beta: [B, L, nv] (fp32);
    state: [num_slots, nv, dk, dv] fp32, updated in place;
    src_slots: [B] slot holding each sequence's initial state;
    dst_slots: [B] (final state only) or [B, L] (state after every position);
    has_initial_state: [B] bool or None (all True); False starts from zeros.
    Returns o: [B, L, nv, dv] fp32."""
    B, L, nv, dv = v.shape
    q, k = prepare_qk(q, k, nv)                      # [B, L, nv, dk]
    dk = q.shape[-1]
    v, g, beta = v.float(), g.float(), beta.float()
    S = state.index_select(0, src_slots)             # [B, nv, dk, dv] (a copy, updated in place)
    if has_initial_state is not None:
        S.masked_fill_(~has_initial_state[:, None, None, None], 0.0)
    Sf = S.view(B * nv, dk, dv)
    per_position = dst_slots.dim() == 2
    o = torch.empty(B, L, nv, dv, dtype=torch.float32, device=v.device)
    for t in range(L):
        S.mul_(g[:, t].exp()[:, :, None, None])
        kt = k[:, t].reshape(B * nv, 1, dk)
        kv = torch.bmm(kt, Sf).view(B, nv, dv)                   # k^T S
        u = (v[:, t] - kv) * beta[:, t, :, None]                  # [B, nv, dv]
        Sf.baddbmm_(kt.transpose(1, 2), u.reshape(B * nv, 1, dv))  # S += k (outer) u
        o[:, t] = torch.bmm(q[:, t].reshape(B * nv, 1, dk), Sf).view(B, nv, dv)
        if per_position:
            state.index_copy_(0, dst_slots[:, t], S)
    if not per_position:
        state.index_copy_(0, dst_slots, S)
    return o
