"""The dashboard's numbers: a short history of the engine's stats and of finished requests, served
as JSON at /api/dashboard (the page polls it every second; Prometheus text is for scrapers).

Every EngineStats message (at most every 0.5 s while the engine is busy, and when it goes idle)
becomes one sample: gauges as sent, rates from the counters' change since the previous message,
the step time split per step, and TTFT / TPOT percentiles over the last minute of finished
requests (the front end's own timestamps)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from backboard.engine.messages import EngineStats
from backboard.engine.request_stream import RequestStream

HISTORY_S = 300.0                  # samples kept
LATENCY_WINDOW_S = 60.0            # TTFT / TPOT percentiles over this window
PERCENTILES = (50, 90, 99)
PHASES = ("schedule", "forward", "sample", "draft", "detokenize")


@dataclass(slots=True)
class FinishedRequest:
    time: float                    # when it finished (time.time())
    ttft_s: float
    tpot_s: float | None           # None: one token only
    e2el_s: float
    output_tokens: int


def request_latencies(s: RequestStream) -> FinishedRequest | None:
    """TTFT, TPOT (mean per token after the first, over the longest completion) and E2EL of a
    finished request, as /metrics counts them; None for aborted or tokenless requests."""
    t = s.timings
    if s.aborted or t.first_output is None or t.finished is None:
        return None
    n = max(s.num_output_tokens)
    tpot = (t.finished - t.first_output) / (n - 1) if n > 1 else None
    return FinishedRequest(t.finished, t.first_output - t.arrival, tpot, t.finished - t.arrival, n)


def percentiles(values: list[float], ps: tuple[int, ...] = PERCENTILES) -> dict[str, float | None]:
    """Nearest-rank percentiles: {"p50": ..., ...}; None for every one when there are no values."""
    if not values:
        return {f"p{p}": None for p in ps}
    v = sorted(values)
    return {f"p{p}": v[min(len(v) - 1, max(0, -(-p * len(v) // 100) - 1))] for p in ps}


def fan_out(*fns: Callable | None) -> Callable:
    """One callback calling each of `fns` that is not None, in order."""
    live = [f for f in fns if f is not None]

    def call(*args) -> None:
        for f in live:
            f(*args)
    return call


class DashboardStats:
    """Fed by the engine client's callbacks (attach); read by the /api/dashboard route."""

    def __init__(self, history_s: float = HISTORY_S, latency_window_s: float = LATENCY_WINDOW_S) -> None:
        self.history_s, self.latency_window_s = history_s, latency_window_s
        self.samples: deque[dict[str, Any]] = deque()
        self.finished: deque[FinishedRequest] = deque()
        self.num_aborted = 0
        self.engine = None
        self._last: EngineStats | None = None
        self._last_detok = 0.0

    def attach(self, engine) -> None:
        """Listen to an AsyncLLM's stats and finished requests (after whatever listens already)."""
        self.engine = engine
        engine.on_stats = fan_out(getattr(engine, "on_stats", None), self.update_engine)
        engine.on_finished = fan_out(getattr(engine, "on_finished", None), self.observe_finished)

    # ---- in -------------------------------------------------------------------------------
    def observe_finished(self, s: RequestStream) -> None:
        self.num_aborted += s.aborted
        r = request_latencies(s)
        if r is not None:
            self.finished.append(r)
        self._prune(time.time())

    def update_engine(self, st: EngineStats) -> None:
        detok = float(getattr(self.engine, "detokenize_time_s", 0.0))
        prev = self._last
        if prev is None or st.time > prev.time:
            self.samples.append(self._sample(prev, st, detok - self._last_detok))
        self._last, self._last_detok = st, detok
        self._prune(st.time)

    def _sample(self, prev: EngineStats | None, st: EngineStats, detok_s: float) -> dict[str, Any]:
        s = st.scheduler
        out: dict[str, Any] = {"t": st.time, "running": s.num_running, "waiting": s.num_waiting,
                               "kv_cache_usage": s.kv_cache_usage, "state_slot_usage": s.state_slot_usage,
                               "prefix_cache_hit_rate": prefix_hit_rate(prev, st) if self._prefix_caching else None}
        out.update(rates(prev, st, detok_s))
        lat = self.latencies(st.time)
        out["ttft_ms"], out["tpot_ms"] = lat["ttft_ms"], lat["tpot_ms"]
        return out

    @property
    def _prefix_caching(self) -> bool:
        """The engine's info says prefix caching is on (engine_info.py)."""
        return bool((getattr(self.engine, "info", None) or {}).get("prefix_caching"))

    def _prune(self, now: float) -> None:
        while self.samples and self.samples[0]["t"] < now - self.history_s:
            self.samples.popleft()
        while self.finished and self.finished[0].time < now - self.latency_window_s:
            self.finished.popleft()

    # ---- out ------------------------------------------------------------------------------
    def latencies(self, now: float) -> dict[str, Any]:
        recent = [r for r in self.finished if r.time >= now - self.latency_window_s]
        ttft = [1000 * r.ttft_s for r in recent]
        tpot = [1000 * r.tpot_s for r in recent if r.tpot_s is not None]
        return {"window_s": self.latency_window_s, "num_requests": len(recent),
                "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot)}

    def engine_state(self) -> dict[str, Any]:
        """The engine's state, its start-up line and its configuration and build."""
        eng = self.engine
        return {"state": getattr(eng, "state", "unknown"), "error": getattr(eng, "error", None),
                "description": getattr(eng, "description", ""),
                "config": dict(getattr(eng, "info", None) or {}),
                "num_unfinished": getattr(eng, "num_unfinished", 0)}

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        """The JSON body of /api/dashboard: the samples newer than `since` (all kept when None),
        the latest values, latencies now, and the engine's configuration."""
        now = time.time()
        self._prune(now)
        samples = [x for x in self.samples if since is None or x["t"] > since]
        return {"time": now, "history_s": self.history_s, "engine": self.engine_state(),
                "latest": self.samples[-1] if self.samples else None,
                "latency": self.latencies(now), "num_aborted": self.num_aborted,
                "samples": samples}


def rates(prev: EngineStats | None, st: EngineStats, detok_s: float) -> dict[str, Any]:
    """Per-second and per-step quantities between two stats messages (zeros for the first)."""
    s = st.scheduler
    p = prev.scheduler if prev is not None else None
    dt = st.time - prev.time if prev is not None else 0.0
    steps = st.num_steps - (prev.num_steps if prev is not None else st.num_steps)
    gen = st.num_generation_tokens - (prev.num_generation_tokens if prev is not None else 0)
    prompt = s.num_prompt_tokens_total - (p.num_prompt_tokens_total if p is not None else 0)
    drafts = s.spec_num_drafts - (p.spec_num_drafts if p is not None else 0)
    accepted = s.spec_num_accepted_tokens - (p.spec_num_accepted_tokens if p is not None else 0)
    return {"generation_tps": gen / dt if dt > 0 else 0.0,
            "prompt_tps": prompt / dt if dt > 0 else 0.0,
            "steps_per_s": steps / dt if dt > 0 else 0.0,
            "step_ms": 1000 * (st.step_time_s - prev.step_time_s) / steps if steps > 0 else None,
            "step_phase_ms": phase_ms(prev, st, steps, detok_s),
            "spec_acceptance_length": 1 + accepted / drafts if drafts > 0 else None}


def phase_ms(prev: EngineStats | None, st: EngineStats, steps: int, detok_s: float) -> dict[str, float]:
    """Milliseconds per step in each phase between two stats messages (zeros without steps)."""
    phases = dict.fromkeys(PHASES, 0.0)
    if steps > 0:
        before = prev.phase_time_s if prev is not None else {}
        for k, v in st.phase_time_s.items():
            phases[k] = 1000 * (v - before.get(k, 0.0)) / steps
        phases["detokenize"] = 1000 * detok_s / steps
    return phases


def prefix_hit_rate(prev: EngineStats | None, st: EngineStats) -> float | None:
    """Hits / queried tokens since the last message, where the engine counts them (vLLM's
    prefix_cache_queries / prefix_cache_hits); None when prefix caching is off."""
    q = getattr(st.scheduler, "prefix_cache_queries", None)
    h = getattr(st.scheduler, "prefix_cache_hits", None)
    if q is None or h is None:
        return None
    if prev is not None:
        q -= getattr(prev.scheduler, "prefix_cache_queries", 0)
        h -= getattr(prev.scheduler, "prefix_cache_hits", 0)
    return h / q if q > 0 else 0.0
