"""Adaptive k: per step, the number of drafts that maximises expected tokens per second, from the
batch size, the measured acceptance and the measured step times.

    E(k)  = 1 + sum_{j<=k} prod_{i<=j} a_i      (tokens per request per step; a_i the acceptance
                                                 rate of draft i given that i-1 were accepted)
    T(k)  = t_verify(n * (1 + k)) + [k > 0] * (t_catchup(n * E(k)) + k * t_draft(n))
    k*    = argmax_k  n * E(k) / T(k),  k in 0..k_max       (n = requests that get drafts)

With k = 0 the proposer does no work at all (not even keeping its cache in step), so speculation
that does not pay is never slower than none. t_verify(rows) is a linear fit over decode steps
(steps with prefill chunks are left out: their rows cost differently); t_catchup is linear in the
rows the head catches up on (a request's accepted drafts + 1 in steady state, a whole prompt after
its prefill: fitted per request, those made a one-request catch-up look like 26 ms where it takes
~2); t_draft is linear in n. Exploration: the first steps alternate k = 1 and 0 so that the fit
sees both row counts; later, every `probe_every` steps try the other side (k = 1 when off, k = 0
when on), less and less often (up to 8x) while off stays the answer.
Speculation is chosen only when its expected rate beats none by `margin` (the fit and the
acceptance are estimates; off costs nothing), and the acceptance prior is modest (0.3).

The model can be wrong where its parts miss a cost (the scheduler's and the output's work per
draft, a step time that is not linear in rows), so it is also held to what whole steps deliver:
the tokens per second of the engine's steady decode steps (from one step's start to the next's,
everything included), per batch-size class, with drafts and without. Where both are measured and
with drafts it delivered less, speculation stays off for that class whatever the model says
(the probes keep measuring it)."""

from __future__ import annotations

import numpy as np


class _LinearFit:
    """y ~ a + b x, exponentially weighted least squares."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.s = np.zeros(5)   # sum w, sum wx, sum wy, sum wxx, sum wxy

    def add(self, x: float, y: float) -> None:
        self.s = self.s * self.decay + np.array([1.0, x, y, x * x, x * y])

    @property
    def ready(self) -> bool:
        return self.s[0] >= 2

    def __call__(self, x: float) -> float:
        w, sx, sy, sxx, sxy = self.s
        if w <= 0:
            return 0.0
        var = sxx * w - sx * sx
        if var <= 1e-9 * max(1.0, sxx * w):
            return sy / w                        # one x seen so far: flat
        b = (sxy * w - sx * sy) / var
        a = (sy - b * sx) / w
        return max(a + b * x, 1e-6)


class _Realized:
    """Tokens and seconds of whole steps, exponentially weighted, by key (batch class, drafted)."""

    def __init__(self, decay: float = 0.9, min_steps: int = 3) -> None:
        self.decay, self.min_steps = decay, min_steps
        self.sums: dict[tuple[int, bool], np.ndarray] = {}    # key -> [tokens, seconds, steps]

    def add(self, key: tuple[int, bool], tokens: int, seconds: float) -> None:
        s = self.sums.get(key, np.zeros(3))
        self.sums[key] = s * np.array([self.decay, self.decay, 1.0]) + np.array([tokens, seconds, 1.0])

    def rate(self, key: tuple[int, bool]) -> float | None:
        """Tokens per second, None until min_steps steps were seen."""
        s = self.sums.get(key)
        return None if s is None or s[2] < self.min_steps else s[0] / max(s[1], 1e-9)


def batch_class(n: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: steps compared with each other have similar costs."""
    return int(n).bit_length()


class AdaptiveK:
    def __init__(self, k_max: int, enabled: bool = True, prior: float = 0.3, explore_steps: int = 10,
                 probe_every: int = 16, margin: float = 1.05) -> None:
        self.k_max, self.enabled = k_max, enabled
        self.explore_steps, self.probe_every, self.margin = explore_steps, probe_every, margin
        self.drafted = np.full(k_max, 10.0)          # pseudo-counts for the prior
        self.accepted = self.drafted * prior
        # slow decay: mostly one row count is seen at a time, the probes keep the other one
        self.verify = _LinearFit(decay=0.98)
        self.catchup = _LinearFit()
        self.draft = _LinearFit()
        self.realized = _Realized()
        self.steps = 0
        self._probe_gap = probe_every
        self._next_probe = explore_steps + probe_every
        self._seen: dict[str, int] = {}

    def acceptance(self) -> np.ndarray:
        """Conditional acceptance rate per draft position."""
        return self.accepted / np.maximum(self.drafted, 1e-9)

    def observe_verify(self, rows: int, seconds: float, speculated: bool) -> None:
        # the first steps of each kind warm caches and code paths: not representative
        key = "spec" if speculated else "plain"
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] > 2:
            self.verify.add(rows, seconds)

    def observe_draft(self, n: int, catchup_rows: int, catchup_s: float, draft_s_per_k: float) -> None:
        self.catchup.add(catchup_rows, catchup_s)
        self.draft.add(n, draft_s_per_k)

    def observe_step(self, n: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A whole steady decode step: n requests, whether they verified drafts, the tokens it
        emitted and the seconds from the previous step's start to this one's."""
        self.realized.add((batch_class(n), drafted), tokens, seconds)

    def realized_loses(self, n: int) -> bool:
        """Steps with drafts delivered fewer tokens per second than steps without, at this size."""
        on, off = (self.realized.rate((batch_class(n), d)) for d in (True, False))
        return on is not None and off is not None and on < off

    def observe_acceptance(self, reached: list[int], accepted: list[int]) -> None:
        d = 0.995
        for j, (nd, na) in enumerate(zip(reached, accepted)):
            if j < self.k_max and nd:
                self.drafted[j] = self.drafted[j] * d + nd
                self.accepted[j] = self.accepted[j] * d + na

    def expected_tokens(self, k: int) -> float:
        return 1.0 + float(np.sum(np.cumprod(self.acceptance()[:k]))) if k else 1.0

    def rate(self, n: int, k: int) -> float:
        t = self.verify(n * (1 + k))
        if k:
            t += self.catchup(n * self.expected_tokens(k)) + k * self.draft(n)
        return n * self.expected_tokens(k) / t

    def choose(self, n: int) -> int:
        self.steps += 1
        if not self.enabled or n == 0:
            return self.k_max
        if self.steps <= self.explore_steps or not (self.verify.ready and self.draft.ready):
            return 1 if self.steps % 2 else 0        # k = 1: the cheapest way to see both row counts
        best = max(range(1, self.k_max + 1), key=lambda k: self.rate(n, k))
        if self.rate(n, best) < self.margin * self.rate(n, 0) or self.realized_loses(n):
            best = 0                                 # speculation must clearly pay: off is never slower
        if self.steps >= self._next_probe:
            # probes of a losing speculation cost: back off while off stays the answer
            self._probe_gap = min(2 * self._probe_gap, 8 * self.probe_every) if best == 0 else self.probe_every
            self._next_probe = self.steps + self._probe_gap
            return 1 if best == 0 else 0
        return best
