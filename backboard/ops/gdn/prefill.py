"""The whole GDN layer between in_proj and out_proj for prefill spans: the torch reference of the
Triton prefill path in ops/triton/gdn_prefill.py (conv -> gating -> chunked delta rule -> gated
norm, as GatedDeltaNet runs a span)."""

from __future__ import annotations

import torch

from backboard.ops.conv1d import causal_conv1d_varlen
from backboard.ops.gdn.chunk import gdn_chunked_varlen
from backboard.ops.gdn.decode import gdn_gates
from backboard.ops.norm import gated_rms_norm_ref


def gdn_prefill_ref(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                    ssm_state: torch.Tensor, cu_seqlens: list[int], slots: torch.Tensor,
                    has_initial_state: torch.Tensor, *, num_k_heads: int, num_v_heads: int,
                    head_k_dim: int, head_v_dim: int, eps: float,
                    norm=gated_rms_norm_ref) -> torch.Tensor:
    """N prefill spans concatenated.

    proj: [P, C + nv*dv + 2*nv] = [qkv | z | b | a], C = 2*nk*dk + nv*dv; cu_seqlens: [N + 1]
    token offsets into proj (host list); slots: [N] GDN state slot of each span; has_initial_state:
    [N] bool (False: the span starts from zero states); conv_state [num_slots, K-1, C] and
    ssm_state [num_slots, nv, dk, dv] fp32 are read and written at `slots` in place.
    `norm` is the gated RMSNorm to finish with (dispatch passes the CPU kernel's).
    Returns [P, nv*dv] in proj's dtype."""
    nk, nv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    P = proj.shape[0]
    C = 2 * nk * dk + nv * dv
    qkv, z, b, a = torch.split(proj, [C, nv * dv, nv, nv], dim=-1)
    g, beta = gdn_gates(a, b, A_log, dt_bias)                                   # [P, nv]
    slot_list, init = slots.tolist(), has_initial_state.tolist()
    mixed = causal_conv1d_varlen(qkv, conv_weight, conv_state, cu_seqlens, slot_list, init)
    q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
    core = gdn_chunked_varlen(q.reshape(P, nk, dk), k.reshape(P, nk, dk), v.reshape(P, nv, dv),
                              g, beta, ssm_state, cu_seqlens, slot_list, init)  # [P, nv, dv] fp32
    o = norm(core.to(proj.dtype), z.reshape(P, nv, dv), norm_weight, eps, proj.dtype)
    return o.reshape(P, nv * dv)
