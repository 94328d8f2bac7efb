"""Greedy decoding's screen: the argmax of an LM head's exact logits from an INT8 copy of the head
plus a few exact rows (sample/greedy_screen.py runs it; the C++ scan: ops/cpu/argmax.h).

At one to a few rows the LM head's GEMV reads the whole bf16 head (254 MB of a 330 MB decode step
of the CPU benchmark checkpoint) for one token per row. The INT8 copy reads half of that, and a
bound on its error tells which rows of the head can hold the maximum:

    exact[r, i] = x_r . w_i    approx[r, i] = scale_i * (x_r . q_i)      (both fp32 accumulations)
    |exact[r, i] - approx[r, i]| <= slack_i * ||x_r||_1

with slack_i = (max_k |w_ik - scale_i q_ik| + ROUNDING * K * u * max_k |w_ik|) * INFLATE: the
quantization error of row i against any x (Hoelder), plus the rounding of the two fp32 dot products
(at most K u sum_k |w_ik x_k| each, u = 2^-24, ROUNDING = 4 covers both and the scale's product)
and a relative margin for the fp32 arithmetic of the scan itself. Every index whose upper end
approx + slack * ||x||_1 reaches the largest lower end is a candidate; the row's maximum is among
them, so the argmax of the candidates' exact logits (lowest index on ties) is the argmax of all
of them. With random bf16 weights and a 248K vocabulary a handful of rows qualify.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backboard.ops.quant import quantize_int8

ROUNDING = 4.0
INFLATE = 1.0 + 1e-4
_UNIT = 2.0 ** -24
_SLAB = 1 << 14                      # rows of the head quantized at a time (fp64 error pass)


@dataclass(frozen=True)
class ArgmaxScreen:
    """An LM head's INT8 copy and error bound: q int8 [N, K], scale fp32 [N], slack fp32 [N]."""

    q: torch.Tensor
    scale: torch.Tensor
    slack: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + self.slack.nbytes


def build_screen(w: torch.Tensor) -> ArgmaxScreen | None:
    """w [N, K] (an LM head, any float dtype) -> its screen; None where w is not finite (no bound
    holds there)."""
    qs, scales, slacks = [], [], []
    for part in w.detach().split(_SLAB):
        q, scale = quantize_int8(part)
        wd = part.double()
        err = (wd - q.double() * scale.double()[:, None]).abs().amax(1)
        slack = (err + ROUNDING * w.shape[1] * _UNIT * wd.abs().amax(1)) * INFLATE
        if not bool(torch.isfinite(slack).all()):
            return None
        qs.append(q)
        scales.append(scale)
        slacks.append(slack.float())
    return ArgmaxScreen(torch.cat(qs), torch.cat(scales), torch.cat(slacks))


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] -> ||x_r||_1 fp32 [R], rounded up (computed in fp64)."""
    return (x.double().abs().sum(-1) * INFLATE).float()


def screen_candidates_ref(approx: torch.Tensor, slack: torch.Tensor,
                          norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """approx fp32 [R, N], slack fp32 [N], norm fp32 [R] -> (int64 [R + 1] offsets, int64 [n]
    indices): row r's candidates, ascending, are indices[offsets[r]:offsets[r + 1]]: every i with
    approx[r, i] + slack[i] * norm[r] >= max_j (approx[r, j] - slack[j] * norm[r])."""
    reach = slack[None, :] * norm[:, None]
    floor = (approx - reach).amax(-1, keepdim=True)
    rows = [torch.nonzero(row, as_tuple=True)[0] for row in approx + reach >= floor]
    counts = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int64)
    return counts.cumsum(0), torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
