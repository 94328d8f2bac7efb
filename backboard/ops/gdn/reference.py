"""The gated delta rule, token by token: the oracle every other form is tested against.

Per value head, state S [dk, dv] (fp32), per token t:
    S = S * exp(g_t);  u = (v_t - k_t^T S) * beta_t;  S = S + k_t (outer) u;  o_t = q_t^T S
with q = l2norm(q) * dk**-0.5 and k = l2norm(k), and key heads shared by r = nv / nk value heads
(value head j uses key head j // r).
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, l2-normalised q (scaled by dk**-0.5) and k, repeated over value heads.

    q, k: [..., nk, dk] -> [..., nv, dk]"""
    r = num_v_heads // q.shape[-2]
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    if r > 1:
        q = q.repeat_interleave(r, dim=-2)
        k = k.repeat_interleave(r, dim=-2)
    return q, k


def gdn_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, initial_state: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence.

    q, k: [T, nk, dk]; v: [T, nv, dv]; g, beta: [T, nv]; initial_state: [nv, dk, dv] or None.
    Returns o [T, nv, dv] (fp32) and the final state [nv, dk, dv] (fp32)."""
    T, nv, dv = v.shape
    q, k = prepare_qk(q, k, nv)
    v, g, beta = v.float(), g.float(), beta.float()
    S = (torch.zeros(nv, q.shape[-1], dv, dtype=torch.float32, device=v.device)
         if initial_state is None else initial_state.float().clone())
    o = torch.empty(T, nv, dv, dtype=torch.float32, device=v.device)
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        kv = torch.einsum("hk,hkv->hv", k[t], S)
        u = (v[t] - kv) * beta[t][:, None]
        S = S + k[t][:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return o, S
