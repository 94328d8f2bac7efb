"""Chunked gated delta rule (the prefill form): the same outputs and final state as the per-token
recurrence, computed chunk by chunk with the WY / UT transform.

Inside a chunk of C tokens with cumulative log decay c_t = sum_{s<=t} g_s:
    A = strict_lower((beta * K) K^T * exp(c_i - c_j))        # [C, C]
    W = (I + A)^-1 (beta * K * exp(c)),  U = (I + A)^-1 (beta * V)
    V' = U - W S                                            # corrected values
    O  = (Q * exp(c)) S + tril(Q K^T * exp(c_i - c_j)) V'
    S  = exp(c_C) S + (K * exp(c_C - c))^T V'

All chunks of all sequences are transformed in one batch; only the scan over a sequence's chunks
is sequential (sequences advance side by side). Padding tokens have g = 0 and beta = 0, so they
leave the state alone."""

from __future__ import annotations

import numpy as np
import torch

from backboard.ops.gdn.reference import prepare_qk


def _chunk_size(max_len: int) -> int:
    """64 (the usual), smaller for batches of short spans (less padding)."""
    c = 16
    while c < 64 and c < max_len:
        c *= 2
    return c


def gdn_chunked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, cu_seqlens: list[int],
                       slots: list[int] | torch.Tensor, has_initial_state: list[bool],
                       chunk: int | None = None) -> torch.Tensor:
    """Several sequences concatenated.

    q, k: [T, nk, dk]; v: [T, nv, dv]; g, beta: [T, nv]; state: [num_slots, nv, dk, dv] fp32,
    read (where has_initial_state) and written back (final state) at `slots[i]`;
    cu_seqlens: [N + 1] token offsets (host list). Returns o: [T, nv, dv] fp32."""
    T, nv, dv = v.shape
    dev = v.device
    lens = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    N = len(lens)
    C = chunk or _chunk_size(int(lens.max()))
    n_chunks = -(-lens // C)                                   # [N]
    chunk_start = np.concatenate([[0], np.cumsum(n_chunks)[:-1]])
    total = int(n_chunks.sum())
    # token index of every (chunk, position); padding points at a zero row appended at T
    seq_of_chunk = np.repeat(np.arange(N), n_chunks)
    local = (np.arange(total) - chunk_start[seq_of_chunk])[:, None] * C + np.arange(C)[None, :]
    idx = np.where(local < lens[seq_of_chunk][:, None],
                   np.asarray(cu_seqlens[:-1])[seq_of_chunk][:, None] + local, T)
    idx_t = torch.from_numpy(idx).to(dev)                       # [total, C]

    qp, kp = prepare_qk(q, k, nv)

    def gather(x: torch.Tensor) -> torch.Tensor:                # [T, ...] -> [nv, total, C, ...]
        x = torch.cat([x.float(), x.new_zeros((1, *x.shape[1:]), dtype=torch.float32)])
        x = x[idx_t]                                            # [total, C, nv, ...]
        return x.movedim(2, 0)
    qc, kc, vc, gc, bc = gather(qp), gather(kp), gather(v), gather(g), gather(beta)
    c = gc.cumsum(-1)                                           # [nv, total, C]
    lower = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = kc * bc[..., None]
    A = ((kb @ kc.transpose(-1, -2)) * decay).tril(-1)
    M = A + torch.eye(C, dtype=A.dtype, device=dev)
    dk = kc.shape[-1]
    WU = torch.linalg.solve_triangular(M, torch.cat([kb * c.exp()[..., None], vc * bc[..., None]], -1),
                                       upper=False, unitriangular=True)
    W, U = WU[..., :dk], WU[..., dk:]
    attn = (qc @ kc.transpose(-1, -2)) * decay                  # includes the diagonal
    q_dec = qc * c.exp()[..., None]
    k_dec = kc * (c[..., -1:] - c).exp()[..., None]
    last = c[..., -1].exp()                                     # [nv, total]

    slots_t = torch.as_tensor(slots, dtype=torch.int64, device=dev)
    init = torch.as_tensor(has_initial_state, dtype=torch.bool, device=dev)
    S = torch.where(init[:, None, None, None], state[slots_t], 0.0)  # [N, nv, dk, dv]
    S = S.transpose(0, 1).contiguous()                          # [nv, N, dk, dv]
    o = torch.empty_like(vc)                                    # [nv, total, C, dv]
    for n in range(int(n_chunks.max())):
        act = np.nonzero(n_chunks > n)[0]
        ids = torch.from_numpy(chunk_start[act] + n).to(dev)
        a_t = torch.from_numpy(act).to(dev)
        Sa = S[:, a_t]                                          # [nv, na, dk, dv]
        v_new = U[:, ids] - W[:, ids] @ Sa
        o[:, ids] = q_dec[:, ids] @ Sa + attn[:, ids] @ v_new
        S[:, a_t] = Sa * last[:, ids, None, None] + k_dec[:, ids].transpose(-1, -2) @ v_new
    state[slots_t] = S.transpose(0, 1)
    out = o.movedim(0, 2).reshape(total * C, nv, dv)           # [total*C, nv, dv]
    valid = torch.from_numpy((idx < T).reshape(-1)).to(dev)
    res = torch.empty(T, nv, dv, dtype=torch.float32, device=dev)
    res[idx_t.reshape(-1)[valid]] = out[valid]
    return res
