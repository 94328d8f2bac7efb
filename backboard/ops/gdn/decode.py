"""The whole GDN layer between in_proj and out_proj for uniform groups (decode / verify rows):
the torch reference of the fused Triton kernels in ops/triton/gdn_decode.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backboard.ops.conv1d import causal_conv1d_update
from backboard.ops.gdn.recurrent import gdn_recurrent
from backboard.ops.norm import gated_rms_norm_ref


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (g, beta) [T, nv] fp32: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float()), b.float().sigmoid()


def gdn_decode_ref(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                   A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                   ssm_state: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                   has_initial_state: torch.Tensor | None = None, *, num_k_heads: int,
                   num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float) -> torch.Tensor:
    """The GDN layer between in_proj and out_proj for B requests x L rows, as GatedDeltaNet does
    it: conv (ops.conv1d) -> gating -> delta rule (ops.gdn.gdn_recurrent) -> gated norm.

    proj: [B*L, C + nv*dv + 2*nv] = [qkv | z | b | a], C = 2*nk*dk + nv*dv; conv_weight: [C, K];
    conv_state: [num_slots, K-1, C]; A_log, dt_bias: [nv]; norm_weight: [dv];
    ssm_state: [num_slots, nv, dk, dv] fp32; src_slots: [B]; dst_slots: [B] (final state) or
    [B, L] (state and conv window after every row); has_initial_state: [B] bool or None.
    Both states are updated in place. Returns [B*L, nv*dv] in proj's dtype."""
    nk, nv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    T = proj.shape[0]
    B = src_slots.shape[0]
    L = T // B
    C = 2 * nk * dk + nv * dv
    qkv, z, b, a = torch.split(proj, [C, nv * dv, nv, nv], dim=-1)
    g, beta = gdn_gates(a, b, A_log, dt_bias)                                     # [T, nv]
    mixed = causal_conv1d_update(qkv.reshape(B, L, C), conv_weight, conv_state, src_slots,
                                 dst_slots, has_initial_state)                    # [B, L, C]
    q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
    core = gdn_recurrent(q.reshape(B, L, nk, dk), k.reshape(B, L, nk, dk), v.reshape(B, L, nv, dv),
                         g.view(B, L, nv), beta.view(B, L, nv), ssm_state, src_slots, dst_slots,
                         has_initial_state)                                       # [B, L, nv, dv]
    o = gated_rms_norm_ref(core.to(proj.dtype).reshape(T, nv, dv), z.reshape(T, nv, dv),
                           norm_weight, eps, proj.dtype)
    return o.reshape(T, nv * dv)
