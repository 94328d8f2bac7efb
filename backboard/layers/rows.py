"""Per-group outputs of a mixer (uniform decode / verify groups, then prefill spans) joined into
the flat batch's rows without a copy per group."""

from __future__ import annotations

import torch


def join_rows(parts: list[tuple[int, torch.Tensor]], T: int) -> torch.Tensor:
    """parts: (first row, rows [n, ...]), at least one -> [T, ...]: the part itself when it is
    the only one (no launch: a decode-only step), one cat when the parts tile rows 0..T-1 in
    order, else copies into a new tensor."""
    starts = [s for s, _ in parts]
    ends = [s + p.shape[0] for s, p in parts]
    if starts and starts[0] == 0 and ends[-1] == T and starts[1:] == ends[:-1]:
        return parts[0][1] if len(parts) == 1 else torch.cat([p for _, p in parts])
    p0 = parts[0][1]
    out = torch.empty((T, *p0.shape[1:]), dtype=p0.dtype, device=p0.device)
    for s, p in parts:
        out[s:s + p.shape[0]] = p
    return out
