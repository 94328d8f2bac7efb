"""Chunked gated delta rule (the prefill form): the same outputs and final state as the per-token
recurrence, computed chunk by chunk with the WY / UT transform.

Inside a chunk of C tokens with cumulative log decay c_t = sum_{s<=t} g_s:
    A = strict_lower((beta * K) K^T * exp(c_i - c_j))        # [C, C]
    W = (I + A)^-1 (beta * K * exp(c)),  U = (I + A)^-1 (beta * V)
    V' = U - W S                                            # corrected values
    O  = (Q * exp(c)) S + tril(Q K^T * exp(c_i - c_j)) V'
    S  = exp(c_C) S + (K * exp(c_C - c))^T V'
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backboard.ops.gdn.reference import prepare_qk


def _chunked_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, S: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, q/k already prepared. q, k: [T, nv, dk]; v: [T, nv, dv]; g, beta: [T, nv];
    S: [nv, dk, dv]. Returns o [T, nv, dv] and the final state."""
    T = v.shape[0]
    pad = (-T) % chunk
    # [nv, N, C, d] with zero padding at the end (g = 0, beta = 0: padded tokens leave S alone)
    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0, 0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, 0, 0, pad))
        x = x.transpose(0, 1)  # [nv, T+pad, ...]
        return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])
    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    gc, bc = to_chunks(g), to_chunks(beta)          # [nv, N, C]
    c = gc.cumsum(-1)
    decay = (c[..., :, None] - c[..., None, :])     # [nv, N, C, C]: c_i - c_j
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = decay.masked_fill(~lower, float("-inf")).exp()
    kb = kc * bc[..., None]
    A = (kb @ kc.transpose(-1, -2)) * decay
    A = A.tril(-1)
    eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
    M = eye + A
    W = torch.linalg.solve_triangular(M, kb * c.exp()[..., None], upper=False, unitriangular=True)
    U = torch.linalg.solve_triangular(M, vc * bc[..., None], upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay      # includes the diagonal
    q_dec = qc * c.exp()[..., None]
    k_dec = kc * (c[..., -1:] - c).exp()[..., None]
    last = c[..., -1].exp()                         # [nv, N]
    o = torch.empty_like(vc)
    for n in range(qc.shape[1]):
        v_new = U[:, n] - W[:, n] @ S
        o[:, n] = q_dec[:, n] @ S + attn[:, n] @ v_new
        S = S * last[:, n, None, None] + k_dec[:, n].transpose(-1, -2) @ v_new
    o = o.reshape(o.shape[0], -1, o.shape[-1]).transpose(0, 1)[:T]
    return o, S


def gdn_chunked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, cu_seqlens: list[int],
                       slots: torch.Tensor, has_initial_state: list[bool],
                       chunk: int = 64) -> torch.Tensor:
    """Several sequences concatenated.

    q, k: [T, nk, dk]; v: [T, nv, dv]; g, beta: [T, nv]; state: [num_slots, nv, dk, dv] fp32,
    read (where has_initial_state) and written back (final state) at `slots[i]`;
    cu_seqlens: [N + 1] token offsets (host list). Returns o: [T, nv, dv] fp32."""
    nv = v.shape[1]
    qp, kp = prepare_qk(q, k, nv)
    v, g, beta = v.float(), g.float(), beta.float()
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for i in range(len(cu_seqlens) - 1):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        slot = slots[i]
        S0 = state[slot] if has_initial_state[i] else torch.zeros_like(state[slot])
        o[s:e], S = _chunked_one(qp[s:e], kp[s:e], v[s:e], g[s:e], beta[s:e], S0, chunk)
        state[slot] = S
    return o
