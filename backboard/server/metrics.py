"""Prometheus metrics (vLLM's names under `backboard:`), on a registry of the server's own.

Request latencies come from the front end's timestamps (and the engine's, for queue time);
gauges and the speculative-decoding counters come from the engine process's SchedulerStats,
which it sends with its step outputs."""

from __future__ import annotations

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 (re-exported for the route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from backboard.engine.messages import EngineStats
from backboard.engine.request_stream import RequestStream

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str, num_spec_tokens: int = 0) -> None:
        prometheus_client.disable_created_metrics()   # no *_created series (as vLLM)
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram("backboard:time_to_first_token_seconds",
                              "Time from request arrival to its first token, seconds", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("backboard:e2e_request_latency_seconds",
                             "Time from request arrival to its last token, seconds", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.tpot = Histogram("backboard:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request, seconds", m,
                              buckets=_TPOT_BUCKETS, registry=r)
        self.queue = Histogram("backboard:request_queue_time_seconds",
                               "Time a request waited in the engine before its first step, seconds", m,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("backboard:num_requests_running", "Requests in the running batch", m,
                             registry=r)
        self.waiting = Gauge("backboard:num_requests_waiting", "Requests waiting to be scheduled", m,
                             registry=r)
        self.kv_usage = Gauge("backboard:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
                              m, registry=r)
        self.slot_usage = Gauge("backboard:state_slot_usage_perc",
                                "Fraction of recurrent-state slots in use (0-1)", m, registry=r)
        self.prompt_tokens = Counter("backboard:prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("backboard:generation_tokens", "Tokens generated", m, registry=r)
        self.success = Counter("backboard:request_success", "Finished completions, by finish reason",
                               m + ["finished_reason"], registry=r)
        self.preemptions = Counter("backboard:num_preemptions", "Preemptions in the engine", m, registry=r)
        self.spec_drafts = Counter("backboard:spec_decode_num_drafts", "Draft rounds verified", m,
                                   registry=r)
        self.spec_draft_tokens = Counter("backboard:spec_decode_num_draft_tokens", "Draft tokens verified",
                                         m, registry=r)
        self.spec_accepted = Counter("backboard:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     m, registry=r)
        self.spec_per_pos = Counter("backboard:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by draft position", m + ["position"], registry=r)
        self.spec_draft_time = Counter("backboard:spec_decode_draft_time_seconds",
                                       "Time spent proposing drafts", m, registry=r)
        self.spec_verify_time = Counter("backboard:spec_decode_verify_time_seconds",
                                        "Time of the steps that verified drafts", m, registry=r)
        self.spec_accept_len = Gauge("backboard:spec_decode_mean_acceptance_length",
                                     "Tokens per draft round: 1 + accepted drafts / rounds (since start)",
                                     m, registry=r)
        self.prefix_queries = Counter("backboard:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", m, registry=r)
        self.prefix_hits = Counter("backboard:prefix_cache_hits",
                                   "Prompt tokens served by the prefix cache (not computed)", m, registry=r)
        self.prefix_hit_rate = Gauge("backboard:prefix_cache_hit_rate",
                                     "Prefix cache hits / queries since start (0-1)", m, registry=r)
        self.prefix_checkpoints = Gauge("backboard:prefix_cache_state_checkpoints",
                                        "GDN state checkpoints held by the prefix cache", m, registry=r)
        self.step_time = Counter("backboard:engine_step_time_seconds",
                                 "Wall time the engine process spent inside step()", m, registry=r)
        self.steps = Counter("backboard:engine_steps", "Engine steps", m, registry=r)
        self.engine_up = Gauge("backboard:engine_up", "1 while the engine process serves; 0 once it died "
                               "(the server exits moments later)", m, registry=r)
        self.pauses = Counter("backboard:stream_pauses", "Requests paused in the engine because their client "
                              "did not take its streamed output (backpressure)", m, registry=r)
        self.timeouts = Counter("backboard:http_connections_timed_out", "Connections closed by a timeout: "
                                "header (idle or slow-loris), send (a client that stopped reading)",
                                m + ["reason"], registry=r)
        e = m + ["engine"]                         # data parallelism: each engine's own (the totals above)
        self.engine_running = Gauge("backboard:engine_num_requests_running", "Requests in one engine's running "
                                    "batch (data parallelism)", e, registry=r)
        self.engine_waiting = Gauge("backboard:engine_num_requests_waiting", "Requests waiting in one engine",
                                    e, registry=r)
        self.engine_kv_usage = Gauge("backboard:engine_kv_cache_usage_perc", "One engine's KV cache usage (0-1)",
                                     e, registry=r)
        self.engine_steps = Gauge("backboard:engine_num_steps", "One engine's steps since start", e, registry=r)
        self.engine_generation_tokens = Gauge("backboard:engine_generation_tokens",
                                              "Tokens one engine generated since start", e, registry=r)
        for reason in ("header", "send"):
            self.timeouts.labels(model_name, reason)
        for c in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.spec_drafts,
                  self.spec_draft_tokens, self.spec_accepted, self.spec_draft_time,
                  self.spec_verify_time, self.step_time, self.steps, self.pauses, self.prefix_queries,
                  self.prefix_hits):
            c.labels(model_name)                   # exported as 0 from the start
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        for pos in range(num_spec_tokens):
            self.spec_per_pos.labels(model_name, str(pos))
        for g in (self.running, self.waiting, self.kv_usage, self.slot_usage, self.spec_accept_len,
                  self.engine_up, self.prefix_hit_rate, self.prefix_checkpoints):
            g.labels(model_name).set(0)
        self._last: EngineStats | None = None

    # ---- from the front end ----------------------------------------------------------------
    def observe_finished(self, s: RequestStream) -> None:
        """A request finished (or was aborted): latencies and token counts."""
        name, t = self.model_name, s.timings
        self.prompt_tokens.labels(name).inc(s.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(sum(s.num_output_tokens))
        for reason in s.finish_reasons:
            self.success.labels(name, reason or "abort").inc()
        if t.engine_received is not None and t.first_scheduled is not None:
            self.queue.labels(name).observe(max(0.0, t.first_scheduled - t.engine_received))
        if t.first_output is None or s.aborted:
            return
        self.ttft.labels(name).observe(t.first_output - t.arrival)
        if t.finished is not None:
            self.e2e.labels(name).observe(t.finished - t.arrival)
            per_child = max(s.num_output_tokens)
            if per_child > 1:
                self.tpot.labels(name).observe((t.finished - t.first_output) / (per_child - 1))

    def observe_pause(self) -> None:
        self.pauses.labels(self.model_name).inc()

    def observe_timeout(self, reason: str) -> None:
        self.timeouts.labels(self.model_name, reason).inc()

    # ---- from the engine process -----------------------------------------------------------
    def update_engine(self, st: EngineStats) -> None:
        name, s = self.model_name, st.scheduler
        self.running.labels(name).set(s.num_running)
        self.waiting.labels(name).set(s.num_waiting)
        self.kv_usage.labels(name).set(s.kv_cache_usage)
        self.slot_usage.labels(name).set(s.state_slot_usage)
        last = self._last
        prev = last.scheduler if last is not None else None

        def inc(counter, now: float, before: float) -> None:
            if now > before:
                counter.labels(name).inc(now - before)

        inc(self.preemptions, s.num_preemptions_total, prev.num_preemptions_total if prev else 0)
        inc(self.spec_drafts, s.spec_num_drafts, prev.spec_num_drafts if prev else 0)
        inc(self.spec_draft_tokens, s.spec_num_draft_tokens, prev.spec_num_draft_tokens if prev else 0)
        inc(self.spec_accepted, s.spec_num_accepted_tokens, prev.spec_num_accepted_tokens if prev else 0)
        inc(self.spec_draft_time, s.spec_draft_time_s, prev.spec_draft_time_s if prev else 0.0)
        inc(self.spec_verify_time, s.spec_verify_time_s, prev.spec_verify_time_s if prev else 0.0)
        if s.spec_num_drafts:
            self.spec_accept_len.labels(name).set(1 + s.spec_num_accepted_tokens / s.spec_num_drafts)
        inc(self.prefix_queries, s.prefix_cache_queries, prev.prefix_cache_queries if prev else 0)
        inc(self.prefix_hits, s.prefix_cache_hits, prev.prefix_cache_hits if prev else 0)
        if s.prefix_cache_queries:
            self.prefix_hit_rate.labels(name).set(s.prefix_cache_hits / s.prefix_cache_queries)
        self.prefix_checkpoints.labels(name).set(s.prefix_cache_checkpoints)
        inc(self.step_time, st.step_time_s, last.step_time_s if last else 0.0)
        inc(self.steps, st.num_steps, last.num_steps if last else 0)
        before = prev.spec_accepted_per_position if prev else []
        for pos, a in enumerate(s.spec_accepted_per_position):
            b = before[pos] if pos < len(before) else 0
            if a > b:
                self.spec_per_pos.labels(name, str(pos)).inc(a - b)
        self._last = st

    def add_engines(self, n: int) -> None:
        """Export every data-parallel engine's gauges (at 0) before its first stats."""
        for i in range(n):
            for g in (self.engine_running, self.engine_waiting, self.engine_kv_usage, self.engine_steps,
                      self.engine_generation_tokens):
                g.labels(self.model_name, str(i)).set(0)

    def update_engine_replica(self, i: int, st: EngineStats) -> None:
        """One data-parallel engine's own stats (update_engine gets their total)."""
        name, s, idx = self.model_name, st.scheduler, str(i)
        self.engine_running.labels(name, idx).set(s.num_running)
        self.engine_waiting.labels(name, idx).set(s.num_waiting)
        self.engine_kv_usage.labels(name, idx).set(s.kv_cache_usage)
        self.engine_steps.labels(name, idx).set(st.num_steps)
        self.engine_generation_tokens.labels(name, idx).set(st.num_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
