"""Adaptive k: per step, the number of drafts that maximises expected tokens per second, from the
batch size, the measured acceptance and the measured step times.

    E(k)  = 1 + sum_{j<=k} prod_{i<=j} a_i      (tokens per request per step; a_i the acceptance
                                                 rate of draft i given that i-1 were accepted)
    T(k)  = t_verify(n * (1 + k)) + [k > 0] * (t_catchup(n * E(k)) + k * t_draft(n))
    k*    = argmax_k  n * E(k) / T(k),  k in 0..k_max       (n = requests that get drafts)

With k = 0 the proposer runs no model (it only keeps the target's hidden states of the step, so
that turning speculation back on catches its cache up instead of leaving holes), so speculation
that does not pay is never slower than none. t_verify(rows) is a linear fit over decode steps
(steps with prefill chunks are left out: their rows cost differently); t_catchup is linear in the
rows the head catches up on (a request's accepted drafts + 1 in steady state, a whole prompt after
its prefill: fitted per request, those made a one-request catch-up look like 26 ms where it takes
~2); t_draft is linear in n. Exploration: the first steps alternate k = 1 and 0 so that the fit
sees both row counts; later, every `probe_every` steps try the other side (when off, a run of
`probe_len` steps at the model's best k; when on, one step at k = 0), less and less often (up to
8x) while off stays the answer.
Speculation is chosen only when its expected rate beats none by `margin` (the fit and the
acceptance are estimates; off costs nothing), and the acceptance prior is modest (0.3).

The model can be wrong where its parts miss a cost (the scheduler's and the output's work per
draft, a step time that is not linear in rows), so it is also held to what whole steps deliver:
the tokens per second of the engine's steady decode steps (from one step's start to the next's,
everything included), per batch-size class, with drafts and without. Where both are measured,
they decide: off where steps with drafts delivered less, on where they delivered `margin` times
more, whatever the model says (the probes keep measuring the other side)."""

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


COLD = 2    # timings of each kind left out first (verify, draft, whole steps per class)


class _Realized:
    """Tokens and seconds of whole steps, exponentially weighted, by key (batch class, drafted)."""

    def __init__(self, decay: float = 0.9, min_steps: int = 3, max_age: int = 256) -> None:
        self.decay, self.min_steps, self.max_age = decay, min_steps, max_age
        self.sums: dict[tuple[int, bool], np.ndarray] = {}    # key -> [tokens, seconds, steps, last step]

    def add(self, key: tuple[int, bool], tokens: int, seconds: float, step: int) -> None:
        s = self.sums.get(key, np.zeros(4))
        s = s * np.array([self.decay, self.decay, 1.0, 0.0]) + np.array([tokens, seconds, 1.0, step])
        self.sums[key] = s

    def rate(self, key: tuple[int, bool], step: int) -> float | None:
        """Tokens per second; None until min_steps steps were counted, or when the last is more
        than max_age steps old (conditions change: the model and the probes decide again)."""
        s = self.sums.get(key)
        if s is None or s[2] < self.min_steps or step - s[3] > self.max_age:
            return None
        return s[0] / max(s[1], 1e-9)


def batch_class(n: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: steps compared with each other have similar costs."""
    return int(n).bit_length()


class AdaptiveK:
    def __init__(self, k_max: int, enabled: bool = True, prior: float = 0.3, explore_steps: int = 10,
                 probe_every: int = 16, margin: float = 1.05, probe_len: int = 4) -> None:
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
        self.probe_len, self._probe_left, self._probe_k = probe_len, 0, 1
        self._next_probe = explore_steps + probe_every
        self._seen: dict = {}                        # timings seen per kind (_warm)

    def acceptance(self) -> np.ndarray:
        """Conditional acceptance rate per draft position."""
        return self.accepted / np.maximum(self.drafted, 1e-9)

    def _warm(self, key) -> bool:
        """Whether this timing of `key` counts: the first COLD of each kind warm caches and code
        paths (SmolLM2, C1: the first drafts put 3.8 ms per draft in the fit, 1-1.5 warm, and the
        exploration steps after them were too few to pull it back)."""
        self._seen[key] = self._seen.get(key, 0) + 1
        return self._seen[key] > COLD

    def observe_verify(self, rows: int, seconds: float, speculated: bool) -> None:
        if self._warm("spec" if speculated else "plain"):
            self.verify.add(rows, seconds)

    def observe_draft(self, n: int, catchup_rows: int, catchup_s: float, draft_s_per_k: float) -> None:
        if self._warm("draft"):
            self.catchup.add(catchup_rows, catchup_s)
            self.draft.add(n, draft_s_per_k)

    def observe_step(self, n: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A whole steady decode step: n requests, whether they verified drafts, the tokens it
        emitted and the seconds from the previous step's start to this one's (the proposer leaves
        out steps whose drafting caught up more than a steady step's rows: after an off stretch)."""
        key = (batch_class(n), drafted)
        if self._warm(key):
            self.realized.add(key, tokens, seconds, self.steps)

    def realized_verdict(self, n: int) -> bool | None:
        """What whole steps at this size say: False where steps with drafts delivered fewer tokens
        per second than steps without, True where they delivered `margin` times more, None where
        that is not measured or in between (the model decides)."""
        on, off = (self.realized.rate((batch_class(n), d), self.steps) for d in (True, False))
        if on is None or off is None:
            return None
        return False if on < off else True if on > self.margin * off else None

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
        if self._probe_left > 0:                     # inside a probe run
            self._probe_left -= 1
            return self._probe_k
        cand = max(range(1, self.k_max + 1), key=lambda k: self.rate(n, k))
        on = self.realized_verdict(n)
        if on is None:
            on = self.rate(n, cand) >= self.margin * self.rate(n, 0)
        best = cand if on else 0                     # speculation must clearly pay: off is never slower
        if self.steps >= self._next_probe:
            # probes of a losing speculation cost: back off while off stays the answer
            self._probe_gap = min(2 * self._probe_gap, 8 * self.probe_every) if best == 0 else self.probe_every
            self._next_probe = self.steps + self._probe_gap
            if best:
                return 0
            # where the model rates speculation close to paying, a run of steps at its best k: the
            # first catches the head up on the off stretch, the rest are steady steps (whole-step
            # rates, acceptance at every draft position); far from it, one step
            close = self.rate(n, cand) >= 0.9 * self.rate(n, 0)
            self._probe_k, self._probe_left = cand, (self.probe_len - 1) if close else 0
            return cand
        return best
