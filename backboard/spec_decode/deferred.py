"""The target's hidden states of the steps a model-based proposer sat out (adaptive k = 0: no head
work), kept so that its next catch-up fills the head's KV cache instead of leaving holes.

A step off costs one copy of its hidden states [T, H] into a ring of rows (allocated on the first
step off, doubled while a step does not fit before its end, up to max_rows x H), and one entry:
the requests' ids, the position of each one's first row, its rows the head would have run over,
where they start in the step and where the step's rows are in the ring. Nothing is done per
request until speculation turns back on, when `take` walks the log once and gathers every
request's rows with one indexed copy per step.
(Keeping each request's rows as they came, a tensor slice per request per step, cost SmolLM2's
draft-head engine at C16 ~0.2 ms of a 15 ms step, every step speculation was off: most steps
there; a new tensor per step, ~1,000 live 18 KB allocations at C16, is gone with the ring.)"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class _Step:
    offset: int                     # the step's first row in the ring
    num_rows: int                   # T: its flat batch's rows, at offset .. offset + T
    where: dict[str, int]           # req_id -> its index in the step
    pos: np.ndarray                 # [B] position of each request's first row
    rows: np.ndarray                # [B] its rows the head runs over (the first ones of its q rows)
    start: np.ndarray               # [B] its first row in hidden


class DeferredSteps:
    """A log of the steps off. A request's rows handed back are the contiguous positions ending
    just before its next catch-up, at most `cap` of them (older ones stay holes); the log holds
    at most `max_rows` rows in all (the oldest steps dropped first: the ones a new step's rows
    overwrite in the ring)."""

    def __init__(self, cap: int, max_rows: int, first_rows: int = 1024) -> None:
        self.cap, self.max_rows, self.first_rows = cap, max_rows, first_rows
        self.steps: deque[_Step] = deque()
        self.num_rows = 0
        self.ring: torch.Tensor | None = None      # [capacity, H], from the first step off
        self._head = 0                             # where the next step's rows go

    def add(self, req_ids: list[str], pos: np.ndarray, rows: np.ndarray, start: np.ndarray,
            hidden: torch.Tensor) -> None:
        """One step off: req_ids / pos / rows / start [B], hidden [T, H] (copied into the ring; a
        step of more than max_rows rows empties the log instead)."""
        T = len(hidden)
        if T > self.max_rows:
            self.clear()
            return
        self._fit(self._head + T, hidden)
        at = self._head if self._head + T <= len(self.ring) else 0
        self._overwrite(at, T)
        self.ring[at:at + T] = hidden
        self.steps.append(_Step(at, T, dict(zip(req_ids, range(len(req_ids)))), pos, rows, start))
        self.num_rows += T
        self._head = at + T

    def _fit(self, rows: int, hidden: torch.Tensor) -> None:
        """A ring of at least `rows` rows where max_rows allows (else the most it allows), like
        hidden [T, H]: doubled from first_rows, the kept rows copied to the same offsets (a GPU
        engine whose speculation is rarely off never holds the whole bound)."""
        ring = self.ring
        if ring is None or ring.shape[1:] != hidden.shape[1:] or ring.dtype != hidden.dtype:
            self.clear()
            ring = None
        size = 0 if ring is None else len(ring)
        if size >= min(rows, self.max_rows):
            return
        new = max(size, min(self.first_rows, self.max_rows))
        while new < min(rows, self.max_rows):
            new = min(2 * new, self.max_rows)
        self.ring = torch.empty(new, *hidden.shape[1:], dtype=hidden.dtype, device=hidden.device)
        if ring is not None:
            self.ring[:size] = ring

    def _overwrite(self, at: int, T: int) -> None:
        """Drop the steps whose rows [at, at + T) of the ring takes, oldest first (on a wrap to 0,
        first the ones past the old head: older than any before it)."""
        if at == 0 and self._head > 0:
            while self.steps and self.steps[0].offset >= self._head:
                self._drop_oldest()
        while self.steps and at <= self.steps[0].offset < at + T:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        self.num_rows -= self.steps.popleft().num_rows

    def clear(self) -> None:
        self.steps.clear()
        self.num_rows = self._head = 0

    def take(self, req_ids: list[str], ends: np.ndarray) -> list[torch.Tensor | None]:
        """For each request, its kept rows ending just before position ends[i] ([n, H], oldest
        first), or None; the log is emptied."""
        spans = [self._span(rid, int(end)) for rid, end in zip(req_ids, ends)]
        out = self._gather(spans)
        self.clear()
        return out

    def _span(self, rid: str, end: int) -> list[tuple[int, int, int]]:
        """(step index, first row, rows) of the request's contiguous rows ending at end, newest
        step first, at most cap rows."""
        segs, n = [], 0
        for e in range(len(self.steps) - 1, -1, -1):
            s = self.steps[e]
            j = s.where.get(rid)
            if j is None or s.rows[j] == 0:
                continue                        # not scheduled that step, or no known rows
            if s.pos[j] + s.rows[j] != end:
                break                           # a gap (a recomputed request, rows dropped)
            take = min(int(s.rows[j]), self.cap - n)
            segs.append((e, int(s.start[j] + s.rows[j] - take), take))
            n, end = n + take, int(s.pos[j])
            if n == self.cap:
                break
        return segs

    def _gather(self, spans: list[list[tuple[int, int, int]]]) -> list[torch.Tensor | None]:
        """The spans' rows, one indexed copy per step that has any."""
        sizes = [sum(t for _, _, t in segs) for segs in spans]
        total = sum(sizes)
        if total == 0:
            return [None] * len(spans)
        ring = self.ring
        buf = torch.empty(total, *ring.shape[1:], dtype=ring.dtype, device=ring.device)
        src: dict[int, list[np.ndarray]] = {}
        dst: dict[int, list[np.ndarray]] = {}
        at = 0
        for segs, size in zip(spans, sizes):
            off = at + size
            for e, r0, t in segs:               # newest first: fill from the span's end
                off -= t
                r0 += self.steps[e].offset
                src.setdefault(e, []).append(np.arange(r0, r0 + t))
                dst.setdefault(e, []).append(np.arange(off, off + t))
            at += size
        for e, s in src.items():
            to, frm = (torch.from_numpy(np.concatenate(x)).to(ring.device) for x in (dst[e], s))
            buf[to] = ring[frm]
        parts = torch.split(buf, sizes)
        return [p if size else None for p, size in zip(parts, sizes)]
