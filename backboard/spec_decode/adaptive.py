"""Adaptive k: per step, the number of drafts that maximises expected tokens per second, from the
batch size, the measured acceptance and the measured step times.

    E(k)  = 1 + sum_{j<=k} prod_{i<=j} a_i      (tokens per drafted request per step; a_i the
                                                 acceptance rate of draft i given that i-1 were accepted)
    k*    = argmax_k  n * (1 + c (E(k) - 1)) / T(n, k),  k in 0..k_max
                                                (n = requests that may get drafts, c = the share of
                                                 them that does: n-gram finds no match for some)

T(n, k) is what whole steps take: the seconds of the engine's steady decode steps at this batch
size class that verified k drafts per request, from one step's start to the next's (drafting,
scheduler, forward, sampling, output: everything). Where a k is not measured (recently), the
model stands in for it, plus what the model missed where both are known:

    T_model(k) = t_verify(n * (1 + c k)) + [k > 0] * (t_catchup(n * E(k)) + k * t_draft(n))

t_verify(rows) is a linear fit over decode steps (steps with prefill chunks are left out: their
rows cost differently); t_catchup is linear in the rows the head catches up on (a request's
accepted drafts + 1 in steady state, a whole prompt after its prefill: fitted per request, those
made a one-request catch-up look like 26 ms where it takes ~2); t_draft is linear in n.
Tokens come from E(k) (the acceptance pools every drafted position of every step), its extra
tokens scaled by the share of them that the measured whole steps with drafts at this size really
gave (realized_share, shrunk toward 1 by STEP_TOKENS_WEIGHT requests): at one request a step
emits 1 to k + 1 tokens, far noisier than its seconds, so E(k) ranks the ks and the share only
corrects their level against k = 0; at sixteen the steps' own tokens lead, and a pooled
acceptance inflated by the answers' easier openings no longer turns speculation on.

With k = 0 the proposer runs no model (it only keeps the target's hidden states of the step, so
that turning speculation back on catches its cache up instead of leaving holes; once off is
`dormant`, confirmed by probes backed off to their longest gap, not even that), so speculation
that does not pay is never slower than none. Exploration: the first steps alternate k = 1 and 0
so that the fit sees both row counts; later, every `probe_every` steps try another side (when
on, one step at k = 0 or at another k, in turn; when off, a run of `probe_len` steps at the best
k, less and less often (up to 8x) while off stays the answer; each batch class on its own
schedule). Speculation is chosen only when its expected rate beats none by `margin` (off costs
nothing). Off at 4 or more requests stands HOLD_OFF steps before the rates are asked again
(probes and a new batch class still come at once); dormant, until the class's next probe (a C16
run's plain decode steps spent ~0.1 ms a step in the proposer, a quarter of it these rates).
The acceptance prior is modest (0.3 for the first draft; each later position is rated like the
one before it until it is measured)."""

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


PRIOR_WEIGHT = 10.0   # pseudo-drafts behind each position's acceptance prior
STEP_TOKENS_WEIGHT = 32.0   # requests' worth of E(k) beside the measured steps' own tokens (realized_share)
COLD = 2    # timings of each kind left out first (verify, draft, whole steps per class and k)
HOLD_OFF, HOLD_MIN_REQUESTS = 4, 4   # off at 4+ requests stands this many steps before the rates are
                                     # asked again (~90 us a step, nearly always the same answer there)


class _StepSeconds:
    """Whole steps by key (batch class, k): their seconds, the median of the last `keep` steps (an
    exponentially weighted mean let one slow step, a GC pause or a noisy neighbour, stand for a k
    probed once in 32-64 steps: SmolLM2 at C1 rated k = 3 at 15.2 ms for 100 steps where its steps
    took 12.2-12.9, chose k = 1 on 55% of the steps and ran 1.22x where k = 2-3 ran 1.34x), and the
    tokens they emitted per request, over the same steps."""

    def __init__(self, keep: int = 7, min_steps: int = 3, max_age: int = 256) -> None:
        self.keep, self.min_steps, self.max_age = keep, min_steps, max_age
        self.samples: dict[tuple[int, int], list[tuple[float, float, int]]] = {}   # (seconds, tokens, requests)
        self.last: dict[tuple[int, int], int] = {}             # key -> step of its newest sample
        self._median: dict[tuple[int, int], float] = {}        # key -> median seconds of its samples

    def add(self, key: tuple[int, int], seconds: float, step: int, tokens: float = 0.0, n: int = 0) -> None:
        """One step: its seconds, its tokens emitted over its n requests (0, 0: not counted)."""
        self.samples[key] = (self.samples.get(key, []) + [(seconds, tokens, n)])[-self.keep:]
        self.last[key] = step
        self._median.pop(key, None)

    def _recent(self, key: tuple[int, int], step: int) -> list[tuple[float, float, int]] | None:
        """The samples; None until min_steps steps were counted, or when the last is more than
        max_age steps old (conditions change: the model and the probes decide again)."""
        s = self.samples.get(key)
        if s is None or len(s) < self.min_steps or step - self.last[key] > self.max_age:
            return None
        return s

    def mean(self, key: tuple[int, int], step: int) -> float | None:
        """The median seconds, or None (_recent); kept until the key's next sample (every choice
        asks for every k: np.median's calls were most of a choice's ~160 us inside a C16 run)."""
        s = self._recent(key, step)
        if s is None:
            return None
        m = self._median.get(key)
        if m is None:
            m = self._median[key] = median([x[0] for x in s])
        return m

    def tokens(self, key: tuple[int, int], step: int) -> tuple[float, int]:
        """(tokens emitted, requests) over the same steps as mean(); (0, 0) when it is None."""
        s = self._recent(key, step)
        return (0.0, 0) if s is None else (float(sum(x[1] for x in s)), int(sum(x[2] for x in s)))


def median(xs: list[float]) -> float:
    """np.median of a short list (the mean of the middle two when even), without numpy's overhead."""
    v, h = sorted(xs), len(xs) // 2
    return float(v[h]) if len(v) % 2 else (v[h - 1] + v[h]) / 2.0


def batch_class(n: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: steps compared with each other have similar costs."""
    return int(n).bit_length()


class AdaptiveK:
    def __init__(self, k_max: int, enabled: bool = True, prior: float = 0.3, explore_steps: int = 10,
                 probe_every: int = 16, margin: float = 1.05, probe_len: int = 4) -> None:
        self.k_max, self.enabled = k_max, enabled
        self.explore_steps, self.probe_every, self.margin = explore_steps, probe_every, margin
        self.prior, self.prior_weight = prior, PRIOR_WEIGHT
        self.drafted = np.zeros(k_max)               # decayed counts of drafts reached / accepted
        self.covered = np.zeros(2)                   # decayed [requests given drafts, requests asked]
        self.accepted = np.zeros(k_max)
        self._expected: np.ndarray | None = None     # [k_max + 1] E(k) of these counts (expected_tokens)
        # slow decay: mostly one row count is seen at a time, the probes keep the other one
        self.verify = _LinearFit(decay=0.98)
        self.catchup = _LinearFit()
        self.draft = _LinearFit()
        self.whole = _StepSeconds()
        self.steps = 0
        self.probe_len, self._probe_left, self._probe_k = probe_len, 0, 1
        self._schedule: dict[int, tuple[int, int]] = {}    # batch class -> (its probe gap, step of its next probe)
        self._dormant: set[int] = set()              # batch classes where off is confirmed (dormant())
        self._probe_turn = 0                         # probes while on: k = 0 and the other ks in turn
        self._seen: dict = {}                        # timings seen per kind (_warm)
        self._held = (-1, 0)                         # (batch class, until step): off, not asked again

    # what is measured ---------------------------------------------------------------------
    def acceptance(self) -> np.ndarray:
        """Conditional acceptance rate per draft position: each position's counts shrunk toward
        the position before it (the first toward `prior`), so a position rarely drafted is rated
        like the one before it. (A fixed prior for every position kept drafts 2 and 3 at 0.3
        where they were accepted at ~0.5: steps at k = 1 only measure draft 1, so k = 1 looked
        best and stayed chosen; SmolLM2, C1: adaptive 1.21x where a fixed k = 2 ran at 1.32x.)"""
        out, before = np.empty(self.k_max), self.prior
        for j in range(self.k_max):
            out[j] = before = (self.accepted[j] + self.prior_weight * before) / (self.drafted[j] + self.prior_weight)
        return out

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

    def observe_step(self, n: int, k: int, seconds: float, tokens: int = 0) -> None:
        """A whole steady decode step: n requests, the drafts per request it verified (k), the
        seconds from the previous step's start to this one's (the proposer leaves out steps
        whose drafting caught up more than a steady step's rows: after an off stretch) and the
        tokens it emitted (0: not known)."""
        key = (batch_class(n), k)
        if self._warm(key):
            self.whole.add(key, seconds, self.steps, tokens, n if tokens else 0)

    def observe_acceptance(self, reached: list[int], accepted: list[int]) -> None:
        self._expected = None
        d = 0.995
        for j, (nd, na) in enumerate(zip(reached, accepted)):
            if j < self.k_max and nd:
                self.drafted[j] = self.drafted[j] * d + nd
                self.accepted[j] = self.accepted[j] * d + na

    def observe_coverage(self, drafted: int, n: int) -> None:
        """A step with k > 0: of n requests, `drafted` got at least one draft."""
        self.covered = self.covered * 0.98 + np.array([drafted, n])

    # what is expected ---------------------------------------------------------------------
    @property
    def coverage(self) -> float:
        """Share of the requests that get drafts (prior: all of them, worth one step of 4)."""
        return float((self.covered[0] + 4.0) / (self.covered[1] + 4.0))

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens per step of a request that got k drafts. All ks at once, kept until the
        next acceptance counts (a choice asks for them a dozen times: model, misses, share)."""
        if self._expected is None:
            self._expected = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.acceptance()))])
        return float(self._expected[k])

    def request_tokens(self, k: int) -> float:
        """Tokens per step of a request, drafted or not: 1 + c (E(k) - 1). (Counting every
        request as drafted, n-gram at C16 on SmolLM2 chose k > 0 on 25-35% of the steps where
        those steps ran at 0.87x the tokens/s of its k = 0 steps: ~5 of 16 requests had drafts,
        and the whole steps' seconds already showed their few rows.)"""
        return 1.0 + self.coverage * (self.expected_tokens(k) - 1.0)

    def model_seconds(self, n: int, k: int) -> float:
        t = self.verify(n * (1 + self.coverage * k))
        if k:
            t += self.catchup(n * self.expected_tokens(k)) + k * self.draft(n)
        return t

    def rate(self, n: int, k: int) -> float:
        """The model's tokens per second (no whole steps)."""
        return n * self.request_tokens(k) / self.model_seconds(n, k)

    def _measured(self, n: int) -> dict[int, float]:
        """Whole-step seconds at this size for each k measured (recently enough)."""
        means = {k: self.whole.mean((batch_class(n), k), self.steps) for k in range(self.k_max + 1)}
        return {k: t for k, t in means.items() if t is not None}

    def step_seconds(self, n: int, k: int, measured: dict[int, float]) -> float:
        """T(n, k): measured, or the model plus its mean miss over the measured ks on the same
        side (k = 0 or k > 0: speculation's misses are its own)."""
        if k in measured:
            return measured[k]
        misses = [t - self.model_seconds(n, j) for j, t in measured.items() if (j > 0) == (k > 0)]
        t = self.model_seconds(n, k)
        return max(t + float(np.mean(misses)), 0.5 * t) if misses else t

    def realized_share(self, n: int) -> float:
        """What the measured whole steps with drafts at this size gave of the extra tokens E(k)
        promised them (1: as promised), their requests shrunk toward 1 by STEP_TOKENS_WEIGHT. (The
        acceptance pools every draft since the start, and a long run's drafts are mostly its
        first steps': the answers' openings, easier to draft. SmolLM2 at C16 rated k = 1 at 1.64
        tokens a request where its steps emitted 1.54-1.58 and ran 6% behind k = 0.) One share
        for every k > 0: at one request a step's 1 to k + 1 tokens are noise, and ranking k = 1
        against k = 2 by them chose worse than E(k) does (simulated, 1.27x vs 1.28x)."""
        got = promised = 0.0
        for k in range(1, self.k_max + 1):
            tokens, reqs = self.whole.tokens((batch_class(n), k), self.steps)
            got, promised = got + tokens - reqs, promised + reqs * (self.request_tokens(k) - 1.0)
        w = STEP_TOKENS_WEIGHT * (self.request_tokens(1) - 1.0)
        return (got + w) / (promised + w) if promised + w > 0 else 1.0

    def rates(self, n: int) -> np.ndarray:
        """[k_max + 1] expected tokens per second for each k."""
        measured = self._measured(n)
        return np.array([n * self.request_tokens(k) / self.step_seconds(n, k, measured)
                         for k in range(self.k_max + 1)]), measured

    # the choice ---------------------------------------------------------------------------
    def choose(self, n: int) -> int:
        self.steps += 1
        if not self.enabled or n == 0:
            return self.k_max
        if self.steps <= self.explore_steps or not (self.verify.ready and self.draft.ready):
            return 1 if self.steps % 2 else 0        # k = 1: the cheapest way to see both row counts
        if self._probe_left > 0:                     # inside a probe run
            self._probe_left -= 1
            return self._probe_k
        c = batch_class(n)
        probe = self.steps >= self._schedule.setdefault(c, (self.probe_every, self.steps + self.probe_every))[1]
        held = self._held
        if not probe and (c in self._dormant or held[0] == c and self.steps < held[1]):
            return 0                                 # dormant: off stands until its next probe
        best, cand, rates = self._rated(n)
        if best:
            self._dormant.discard(c)
        elif n >= HOLD_MIN_REQUESTS:
            self._held = (c, self.steps + HOLD_OFF)
        return self._probe(c, best, cand, rates) if probe else best

    def dormant(self, n: int) -> bool:
        """Off at n requests is confirmed: its probes backed off to their longest gap and off
        stayed the answer (until a choice at this batch class speculates)."""
        return batch_class(n) in self._dormant

    def _rated(self, n: int) -> tuple[int, int, np.ndarray]:
        """(the best k, the best k > 0, the rates of every k) at n requests."""
        rates, measured = self.rates(n)
        cand = 1 + int(np.argmax(rates[1:]))                           # E(k) ranks the ks
        extra = self.request_tokens(cand) - 1.0                         # its level: what steps gave
        rates[cand] *= (1.0 + self.realized_share(n) * extra) / (1.0 + extra)
        best = cand if rates[cand] > self.margin * rates[0] else 0   # speculation must pay: off is never slower
        return best, cand, rates

    def _probe(self, c: int, best: int, cand: int, rates: np.ndarray) -> int:
        """A step (or a run) on another side, so that whole steps keep measuring it. On: one
        step at k = 0 or at another k, in turn (each is a clean whole-step sample: the step
        drafts and verifies that k). Off: probes of a losing speculation cost, so they back off
        while off stays the answer; where speculation is rated close to paying, a run at its
        best k (the first catches the head up on the off stretch, the rest are steady steps
        with acceptance at every draft position); far from it, one step. Each batch class keeps
        its own gap (c): a drained batch that speculates does not bring a full one's probes back.
        Off at the longest gap makes the class dormant until a choice there speculates."""
        gap = min(2 * self._schedule[c][0], 8 * self.probe_every) if best == 0 else self.probe_every
        self._schedule[c] = (gap, self.steps + gap)
        if best == 0 and gap == 8 * self.probe_every:
            self._dormant.add(c)
        else:
            self._dormant.discard(c)
        if best:
            others = [k for k in range(1, self.k_max + 1) if k != best]
            self._probe_turn += 1
            return others[self._probe_turn // 2 % len(others)] if others and self._probe_turn % 2 == 0 else 0
        close = rates[cand] >= 0.9 * rates[0]
        self._probe_k, self._probe_left = cand, (self.probe_len - 1) if close else 0
        return cand
