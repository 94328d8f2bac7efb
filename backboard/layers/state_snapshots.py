"""GDN prefill spans that also leave their state at positions inside them.

A prefix-cache checkpoint inside a prefill chunk (the prompt's end p = n - 1, an interval, a branch
point; core/prefix_cache.py) needs the GDN state after exactly p tokens. Ending the chunk there
cost a whole step more for the last token(s): at concurrency 1 another pass over the weights before
the first token (a 256-token prompt on the CPU benchmark checkpoint: 35.4 ms to the first token,
31.3 ms without the stop). Instead the step takes the snapshot: the GDN layers cut each span at its
snapshot offsets and run the pieces in rounds. Round j runs the j-th piece of every span that has
one through the backend's own prefill op (Triton, the CPU kernel or the reference: one call a
round), each piece on its span's slot; after round j, the slot of each span cut there is copied into
the snapshot's slot. The next piece continues from the span's slot, which holds the state after the
cut (the conv state included: it is the last K - 1 inputs before the cut). Everything outside the
GDN recurrence (GEMMs, attention, MLPs) runs over the whole chunk once."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from backboard.forward_context import StateSnapshot
from backboard.layers.rows import join_rows

# (proj rows [p, ...], cu_seqlens [n + 1], slots [n], has_initial_state [n]) -> [p, nv*dv]
PrefillFn = Callable[[torch.Tensor, list[int], torch.Tensor, torch.Tensor], torch.Tensor]


def prefill_with_snapshots(prefill: PrefillFn, proj: torch.Tensor, cu_seqlens: list[int],
                           slots: torch.Tensor, has_initial_state: torch.Tensor,
                           snapshots: Sequence[StateSnapshot],
                           states: Sequence[torch.Tensor]) -> torch.Tensor:
    """proj [P, ...] of N spans (cu_seqlens [N + 1], host); slots, has_initial_state [N];
    snapshots ordered by span, then offset; states: the layer's state tensors, slot-major
    (conv [S, K-1, C], ssm [S, nv, dk, dv]). Returns [P, nv*dv], as `prefill` over the spans."""
    cuts, snap_slots = _cuts(cu_seqlens, snapshots)
    parts: list[tuple[int, torch.Tensor]] = []
    for j in range(max(len(c) for c in cuts) - 1):
        spans = [i for i, c in enumerate(cuts) if len(c) > j + 1]
        bounds = [(cu_seqlens[i] + cuts[i][j], cu_seqlens[i] + cuts[i][j + 1]) for i in spans]
        idx = torch.tensor(spans, device=slots.device)
        init = has_initial_state.index_select(0, idx) if j == 0 else \
            torch.ones(len(spans), dtype=torch.bool, device=slots.device)
        out = prefill(_rows(proj, bounds), _cu(bounds), slots.index_select(0, idx), init)
        parts += _pieces(out, bounds)
        taken = [(i, snap_slots[i][j]) for i in spans if j < len(snap_slots[i])]
        if taken:
            _copy_slots(states, slots, taken)
    return join_rows(sorted(parts, key=lambda p: p[0]), proj.shape[0])


def _cuts(cu_seqlens: list[int], snapshots: Sequence[StateSnapshot]):
    """Per span: its piece boundaries [0, offsets..., L] and the snapshot slot of each offset."""
    n = len(cu_seqlens) - 1
    cuts = [[0] for _ in range(n)]
    snap_slots: list[list[int]] = [[] for _ in range(n)]
    for s in snapshots:
        length = cu_seqlens[s.span + 1] - cu_seqlens[s.span]
        if not cuts[s.span][-1] < s.offset < length:
            raise ValueError(f"snapshot at {s.offset} of a {length}-token span: offsets must rise "
                             "and stay inside the span")
        cuts[s.span].append(s.offset)
        snap_slots[s.span].append(s.slot)
    for i in range(n):
        cuts[i].append(cu_seqlens[i + 1] - cu_seqlens[i])
    return cuts, snap_slots


def _rows(proj: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """proj's rows of the pieces, in order: a view when they are one run of rows."""
    if all(b[0] == a[1] for a, b in zip(bounds, bounds[1:])):
        return proj[bounds[0][0]:bounds[-1][1]]
    return torch.cat([proj[s:e] for s, e in bounds])


def _cu(bounds: list[tuple[int, int]]) -> list[int]:
    cu = [0]
    for s, e in bounds:
        cu.append(cu[-1] + e - s)
    return cu


def _pieces(out: torch.Tensor, bounds: list[tuple[int, int]]) -> list[tuple[int, torch.Tensor]]:
    """A round's output split back into (first row in proj, rows) per piece."""
    pieces, at = [], 0
    for s, e in bounds:
        pieces.append((s, out[at:at + e - s]))
        at += e - s
    return pieces


def _copy_slots(states: Sequence[torch.Tensor], slots: torch.Tensor, taken: list[tuple[int, int]]) -> None:
    """states[t][dst] = states[t][slots[span]] for each (span, dst)."""
    dev = slots.device
    src = slots.index_select(0, torch.tensor([i for i, _ in taken], device=dev))
    dst = torch.tensor([d for _, d in taken], device=dev)
    for t in states:
        t.index_copy_(0, dst, t.index_select(0, src))
