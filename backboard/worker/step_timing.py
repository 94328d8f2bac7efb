"""The forward pass's share of a step, for the dashboard's step-time split.

On a CPU the host clock is the measure (torch ops run synchronously). On CUDA the host only
launches work, so the runner records a pair of events around the forward and reads their
elapsed time once the GPU has passed the second one (in a later step at the latest): nothing
waits for the GPU that would not wait anyway, and a step pays for two event records."""

from __future__ import annotations

import time
from collections import deque

import torch

_MAX_PENDING = 256              # a GPU this far behind has stopped: drop the oldest pairs


class ForwardTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._t0 = 0.0
        self._start: torch.cuda.Event | None = None
        self._pending: deque = deque(maxlen=_MAX_PENDING)   # (start, end) events not yet read
        self._seconds = 0.0
        self._running = False

    def start(self) -> None:
        self._running = True
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        """End the interval begun by start(); a second call does nothing."""
        if not self._running:
            return
        self._running = False
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start, end))
        else:
            self._seconds += time.perf_counter() - self._t0

    def collect(self) -> float:
        """Seconds of forward measured since the last collect (CUDA: of the steps the GPU has
        finished)."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._seconds += start.elapsed_time(end) / 1000.0
        out, self._seconds = self._seconds, 0.0
        return out
