"""The page's server side in process (no engine process): the dashboard's numbers from engine
stats and finished requests, the /api/ routes and their API key, the page and static files,
--disable-frontend, and the scorecard viewer's folder listing."""

from __future__ import annotations

import json
import os
import time
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from backboard.core.outputs import SchedulerStats
from backboard.engine.messages import EngineStats
from backboard.engine.request_stream import RequestTimings
from backboard.server.api import ServerState, build_app
from backboard.server.dashboard import DashboardStats, percentiles
from backboard.server.frontend import STATIC_DIR
from backboard.server.metrics import ServerMetrics
from tests.unit.test_bench_scorecard import results  # noqa: F401 (fixture)

KEY = "sekrit"


def _stats(t: float, steps: int, gen: int, prompt: int, phases: dict, step_time: float, running=2,
           drafts=0, accepted=0, kv=0.25) -> EngineStats:
    s = SchedulerStats(num_running=running, num_waiting=1, kv_cache_usage=kv, state_slot_usage=0.5,
                       spec_num_drafts=drafts, spec_num_accepted_tokens=accepted,
                       num_prompt_tokens_total=prompt)
    return EngineStats(s, steps, step_time, 10.0, t, gen, phases)


def _stream(arrival: float, first: float, finished: float, n_tokens: int, aborted: bool = False):
    t = RequestTimings(arrival, first_output=first, finished=finished)
    return SimpleNamespace(timings=t, num_output_tokens=[n_tokens], aborted=aborted)


class FakeEngine:
    state, error, num_unfinished = "ready", None, 0
    description = "KV cache: 10 blocks"
    info = {"dtype": "float32", "device": "cpu", "threads": 3, "kernels": "torch references",
            "speculative": {"method": "ngram"}}

    def __init__(self) -> None:
        self.detokenize_time_s = 0.0
        self.seen: list = []
        self.on_stats = self.seen.append           # what /metrics listens with
        self.on_finished = None


def test_rates_step_split_and_acceptance_from_engine_stats():
    eng = FakeEngine()
    dash = DashboardStats()
    dash.attach(eng)
    eng.on_stats(_stats(100.0, 10, 50, 300, {"schedule": 0.01, "forward": 0.2, "sample": 0.02, "draft": 0.0}, 0.25))
    eng.detokenize_time_s = 0.004
    eng.on_stats(_stats(100.5, 30, 170, 700, {"schedule": 0.03, "forward": 0.6, "sample": 0.06, "draft": 0.01},
                        0.75, drafts=8, accepted=12, kv=0.5))
    assert len(eng.seen) == 2, "the metrics callback still runs"
    first, s = dash.samples
    assert first["generation_tps"] == 0.0 and first["step_ms"] is None   # nothing to compare with
    assert s["generation_tps"] == pytest.approx(120 / 0.5) and s["prompt_tps"] == pytest.approx(400 / 0.5)
    assert s["steps_per_s"] == pytest.approx(40) and s["step_ms"] == pytest.approx(25.0)
    assert s["step_phase_ms"] == pytest.approx({"schedule": 1.0, "forward": 20.0, "sample": 2.0,
                                                "draft": 0.5, "detokenize": 0.2})
    assert s["spec_acceptance_length"] == pytest.approx(1 + 12 / 8)
    assert (s["running"], s["waiting"], s["kv_cache_usage"]) == (2, 1, 0.5)
    assert s["prefix_cache_hit_rate"] is None                           # prefix caching off


def test_prefix_cache_hit_rate_between_samples():
    """Hits over queried tokens since the previous sample, when the engine says caching is on."""
    eng = FakeEngine()
    eng.info = {**FakeEngine.info, "prefix_caching": True}
    dash = DashboardStats()
    dash.attach(eng)
    for t, q, h in ((100.0, 100, 10), (100.5, 300, 190)):
        st = _stats(t, 10, 50, 300, {}, 0.25)
        st.scheduler.prefix_cache_queries, st.scheduler.prefix_cache_hits = q, h
        eng.on_stats(st)
    first, s = dash.samples
    assert first["prefix_cache_hit_rate"] == pytest.approx(0.1)
    assert s["prefix_cache_hit_rate"] == pytest.approx(180 / 200)


def test_latency_percentiles_over_the_last_minute(monkeypatch):
    import backboard.server.dashboard as D

    now = 1000.0
    monkeypatch.setattr(D.time, "time", lambda: now)
    dash = DashboardStats()
    dash.observe_finished(_stream(now - 200, now - 199.0, now - 190, 11))     # out of the window
    for i in range(1, 11):                        # TTFT 10..100 ms, TPOT (1 s - TTFT) / 10 tokens
        dash.observe_finished(_stream(now - 5, now - 5 + i / 100, now - 4, 11))
    dash.observe_finished(_stream(now - 3, now - 2.9, now - 2, 11, aborted=True))
    dash.observe_finished(_stream(now - 3, now - 2.9, now - 2, 1))            # one token: no TPOT
    lat = dash.snapshot()["latency"]
    assert lat["num_requests"] == 11
    assert lat["ttft_ms"] == pytest.approx({"p50": 60, "p90": 100, "p99": 100})
    assert lat["tpot_ms"]["p50"] == pytest.approx(94.0) and lat["tpot_ms"]["p99"] == pytest.approx(99.0)
    assert dash.snapshot()["num_aborted"] == 1


def test_percentiles_nearest_rank():
    assert percentiles(list(range(1, 101))) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


class FakeTokenizer:
    def __init__(self, template: str) -> None:
        self.hf = SimpleNamespace(chat_template=template)


def _client(frontend=True, api_key=KEY, template="{{ enable_thinking }}", scorecard_dir=None):
    eng = FakeEngine()
    state = ServerState(eng, FakeTokenizer(template), ["tiny"], "/models/tiny", 512, ServerMetrics("tiny"),
                        api_key=api_key, frontend=frontend, scorecard_dir=scorecard_dir)
    return TestClient(build_app(state)), eng


def test_page_and_static_files_served_with_a_strict_policy():
    client, _ = _client()
    for path in ("/", "/dashboard", "/scorecards"):
        r = client.get(path)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        assert '<script type="module" src="/static/app.js">' in r.text
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    for name in ("app.js", "chat.js", "dashboard.js", "plot.js", "render.js", "api.js", "app.css"):
        assert client.get(f"/static/{name}").status_code == 200, name
    page = (STATIC_DIR / "index.html").read_text() + "".join(p.read_text() for p in STATIC_DIR.glob("*.js"))
    assert "http://" not in page and "https://" not in page, "nothing may load from elsewhere"


def test_api_routes_want_the_key_and_report_the_engine():
    client, eng = _client()
    assert client.get("/api/auth").json() == {"api_key_required": True}
    assert client.get("/api/dashboard").status_code == 401
    assert client.get("/api/info", headers={"Authorization": "Bearer wrong"}).status_code == 401
    h = {"Authorization": f"Bearer {KEY}"}
    info = client.get("/api/info", headers=h).json()
    assert info["models"] == ["tiny"] and info["max_model_len"] == 512 and info["thinking"] is True
    assert info["engine"]["config"]["threads"] == 3
    t0 = time.time() - 2
    eng.on_stats(_stats(t0, 1, 1, 5, {}, 0.1))
    eng.on_stats(_stats(t0 + 1, 3, 9, 5, {}, 0.3, running=4))
    snap = client.get("/api/dashboard", headers=h).json()
    assert [s["t"] for s in snap["samples"]] == [t0, t0 + 1]
    assert snap["latest"]["running"] == 4 and snap["latest"]["generation_tps"] == pytest.approx(8.0)
    assert snap["engine"]["config"]["dtype"] == "float32" and snap["engine"]["state"] == "ready"
    assert set(snap["latency"]) >= {"ttft_ms", "tpot_ms", "window_s", "num_requests"}
    newer = client.get(f"/api/dashboard?since={t0!r}", headers=h).json()
    assert [s["t"] for s in newer["samples"]] == [t0 + 1]
    json.dumps(snap, allow_nan=False)


def test_without_key_or_thinking():
    client, _ = _client(api_key=None, template="{{ messages }}")
    assert client.get("/api/auth").json() == {"api_key_required": False}
    assert client.get("/api/info").json()["thinking"] is False


def test_disable_frontend_leaves_the_api_alone():
    client, _ = _client(frontend=False, api_key=None)
    for path in ("/", "/dashboard", "/static/app.js", "/api/dashboard", "/api/info"):
        assert client.get(path).status_code == 404, path
    assert client.get("/version").status_code == 200


def test_scorecard_viewer_lists_and_renders_folders(results, tmp_path):  # noqa: F811
    from backboard.bench.scorecard import write_scorecard

    root = tmp_path / "library"
    kept = root / "kept-2026"
    write_scorecard(results, out_dir=str(kept), plots=False)
    (kept / "README.md").write_text("# First sweep\nnotes\n")
    (root / "not-results").mkdir()
    client, _ = _client(api_key=None, scorecard_dir=str(root))
    listing = client.get("/api/scorecards").json()
    assert listing["root"] == str(root)
    [entry] = listing["scorecards"]
    assert (entry["name"], entry["title"], entry["totals"]["ours"]) == ("kept-2026", "First sweep", "backboard")
    vllm = entry["totals"]["totals"]["vllm"]
    assert (vllm["wins"], vllm["total"]) == (4, 26)
    r = client.get("/api/scorecards/kept-2026")
    assert r.status_code == 200 and "backboard vs vllm: 4/26 wins" in r.text and "data:image/png;base64," in r.text
    for bad in ("nope", "../kept-2026", "kept-2026/../../etc"):
        assert client.get(f"/api/scorecards/{bad}").status_code == 404, bad
    # a report written by `bench scorecard --html` is served as it is, unless the scorecard is newer
    (kept / "scorecard.html").write_text("<p>as written</p>")
    assert client.get("/api/scorecards/kept-2026").text == "<p>as written</p>"
    later = os.path.getmtime(kept / "scorecard.html") + 10
    os.utime(kept / "scorecard.json", (later, later))
    assert "4/26 wins" in client.get("/api/scorecards/kept-2026").text


def test_committed_results_are_the_default_library():
    from backboard.server.frontend import ScorecardLibrary, default_scorecard_dir

    root = default_scorecard_dir()
    assert root is not None and root.endswith(os.path.join("benchmarks", "results"))
    names = [s["name"] for s in ScorecardLibrary(root).listing()]
    assert "cpu-vs-vllm-20261129" in names


def test_static_files_are_package_data():
    """Every file of the page ships in the wheel (pyproject's package-data globs)."""
    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["backboard"]
    files = [p.relative_to(root / "backboard").as_posix() for p in STATIC_DIR.rglob("*") if p.is_file()]
    assert "server/static/index.html" in files
    assert [f for f in files if not any(fnmatch(f, g) for g in globs)] == []
