"""Adaptive k: per step, the number of drafts that maximises expected tokens per second, from the
batch size, the measured acceptance and the measured step times.

    E(k)  = 1 + sum_{j<=k} prod_{i<=j} a_i          (tokens per request per step; a_i the
                                                     acceptance rate of draft i given i-1 accepted)
    T(k)  = t_verify(n * (1 + k)) + k * t_draft(n)   (seconds per step for n requests)
    k*    = argmax_k  n * E(k) / T(k),  k in 0..k_max

t_verify(rows) and t_draft(n) are linear fits updated online (exponentially weighted); with k = 0
chosen, a probe with k = 1 every `probe_every` steps keeps the acceptance estimate alive."""

from __future__ import annotations

import numpy as np


class _LinearFit:
    """y ~ a + b x, exponentially weighted least squares."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.s = np.zeros(5)   # sum w, sum wx, sum wy, sum wxx, sum wxy

    def add(self, x: float, y: float) -> None:
        self.s = self.s * self.decay + np.array([1.0, x, y, x * x, x * y])

    def __call__(self, x: float) -> float | None:
        w, sx, sy, sxx, sxy = self.s
        if w < 2:
            return None
        var = sxx * w - sx * sx
        if var <= 1e-9 * max(1.0, sxx * w):
            return sy / w                        # one row count seen so far: flat
        b = (sxy * w - sx * sy) / var
        a = (sy - b * sx) / w
        return max(a + b * x, 1e-6)


class AdaptiveK:
    def __init__(self, k_max: int, enabled: bool = True, prior: float = 0.6, probe_every: int = 32) -> None:
        self.k_max, self.enabled, self.probe_every = k_max, enabled, probe_every
        self.drafted = np.full(k_max, 20.0)          # pseudo-counts for the prior
        self.accepted = self.drafted * prior
        self.verify = _LinearFit()
        self.draft = _LinearFit()
        self.steps = 0

    def acceptance(self) -> np.ndarray:
        """Conditional acceptance rate per draft position."""
        return self.accepted / np.maximum(self.drafted, 1e-9)

    def observe(self, rows: int, verify_s: float, n_draft_reqs: int, draft_s_per_step: float | None,
                drafted_per_pos: list[int], accepted_per_pos: list[int]) -> None:
        self.verify.add(rows, verify_s)
        if draft_s_per_step is not None and n_draft_reqs:
            self.draft.add(n_draft_reqs, draft_s_per_step)
        d = 0.995
        for j, (nd, na) in enumerate(zip(drafted_per_pos, accepted_per_pos)):
            if j < self.k_max and nd:
                self.drafted[j] = self.drafted[j] * d + nd
                self.accepted[j] = self.accepted[j] * d + na

    def expected_tokens(self, k: int) -> float:
        a = self.acceptance()
        return 1.0 + float(np.sum(np.cumprod(a[:k]))) if k else 1.0

    def choose(self, n: int) -> int:
        self.steps += 1
        if not self.enabled or n == 0:
            return self.k_max
        best_k, best = self.k_max, -1.0
        for k in range(self.k_max + 1):
            tv = self.verify(n * (1 + k))
            td = self.draft(n) if k else 0.0
            if tv is None or td is None:
                return self.k_max                # not enough measurements yet: explore
            rate = n * self.expected_tokens(k) / (tv + k * td)
            if rate > best:
                best_k, best = k, rate
        if best_k == 0 and self.steps % self.probe_every == 0:
            return 1
        return best_k
