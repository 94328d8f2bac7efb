"""Greedy tokens without the full LM head: its INT8 screen picks the candidate rows (ops/argmax_screen.py
has the bound), the bf16 head's exact logits of those rows pick the token. The result is the
argmax of the exact logits, as logits + argmax gives it, at about half the LM head's bytes."""

from __future__ import annotations

import torch

from backboard.ops import dispatch
from backboard.ops.argmax_screen import ArgmaxScreen, row_norms

# ||x||_1 beyond this could overflow the scan's fp32 bounds: such rows take the full head
NORM_MAX = 1e30


def screened_argmax(h: torch.Tensor, w: torch.Tensor, screen: ArgmaxScreen) -> torch.Tensor:
    """h [R, K] (the final-normed hidden rows), w [V, K] (the LM head) -> int64 [R]: the argmax of
    the exact logits h @ w^T in fp32 (first index on ties), from the INT8 screen and the exact
    logits of the candidates."""
    norm = row_norms(h)
    if not bool((norm < NORM_MAX).all()):                # not finite, or too large for the bound
        return dispatch.argmax(dispatch.linear(h, w, out_dtype=torch.float32))
    approx = dispatch.int8_linear(h, screen.q, screen.scale, out_dtype=torch.float32)
    offsets, idx = dispatch.screen_candidates(approx, screen.slack, norm)
    return torch.tensor([_best(h[r:r + 1], w, idx[offsets[r]:offsets[r + 1]]) for r in range(h.shape[0])],
                        dtype=torch.int64)


def _best(x: torch.Tensor, w: torch.Tensor, cand: torch.Tensor) -> int:
    """x [1, K], candidates int64 [n] ascending -> the candidate with the largest exact logit."""
    exact = dispatch.linear(x, w.index_select(0, cand), out_dtype=torch.float32)
    return int(cand[int(exact.argmax())])
