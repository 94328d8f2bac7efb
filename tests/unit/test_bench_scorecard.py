"""The scorecard on synthetic sweep results with known winners, margins and run-pair agreement."""

from __future__ import annotations

import json
import os

import pytest

from backboard.bench.scorecard import METRICS, build_scorecard, write_scorecard


def _result(target: str, run: int, isl: int, conc: int, thr: float, lat: float,
            ttft_median: float | None = None, run_failed: bool = False) -> dict:
    r = {"output_throughput": thr, "run_failed": run_failed, "failed": 9 if run_failed else 0,
         "sweep": {"target": target, "run": run, "input_len": isl, "output_len": 64,
                   "concurrency": conc}}
    for m in ("ttft", "tpot", "e2el"):
        for s in ("mean", "median", "p90", "p99"):
            r[f"{s}_{m}_ms"] = lat
    if ttft_median is not None:
        r["median_ttft_ms"] = ttft_median
    return r


def _write(d, r: dict) -> None:
    s = r["sweep"]
    name = f"isl{s['input_len']}-c{s['concurrency']}-run{s['run']}.json"
    path = os.path.join(d, s["target"], name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(r, f)


@pytest.fixture
def results(tmp_path):
    """Two points; at each, ours wins throughput (2 of 3 run pairs agree) and median TTFT
    (2 of 3 agree) and loses the 11 other latencies by 2x (all pairs agree)."""
    d = str(tmp_path)
    for isl in (128, 512):
        for run, (thr, ttft_v) in enumerate([(110.0, 40.0), (90.0, 60.0), (120.0, 70.0)], 1):
            _write(d, _result("backboard", run, isl, 4, thr, lat=20.0, ttft_median=50.0))
            _write(d, _result("vllm", run, isl, 4, 100.0, lat=10.0, ttft_median=ttft_v))
    # a failed run is left out of the means (it would flip the throughput verdict)
    _write(d, _result("backboard", 4, 128, 4, 1.0, lat=1e6, run_failed=True))
    # files without a sweep entry are ignored
    with open(os.path.join(d, "environment.json"), "w") as f:
        json.dump({"cpu_model": "x"}, f)
    return d


def test_thirteen_metrics():
    assert len(METRICS) == 13
    assert METRICS[0] == ("output_throughput", "output tok/s", True)
    assert all(not higher for _, _, higher in METRICS[1:])


def test_winners_margins_and_run_pairs(results):
    sc = build_scorecard(results, ours="backboard")
    assert sc["targets"] == ["backboard", "vllm"] and sc["competitors"] == ["vllm"]
    assert {o: (t["wins"], t["total"]) for o, t in sc["totals"].items()} == {"vllm": (4, 26)}
    by_metric = sc["totals"]["vllm"]["by_metric"]
    assert by_metric["output_throughput"] == by_metric["median_ttft_ms"] == {"wins": 2, "total": 2}
    assert by_metric["p99_tpot_ms"] == {"wins": 0, "total": 2}
    assert sc["setups"]["vllm"] == {"backends": ["vllm"], "notes": []}
    p = sc["points"][0]
    assert (p["input_len"], p["output_len"], p["concurrency"]) == (128, 64, 4)
    assert p["runs"] == {"backboard": [1, 2, 3], "vllm": [1, 2, 3]}

    thr = p["metrics"]["output_throughput"]
    assert thr["means"]["backboard"] == pytest.approx(320 / 3)
    c = thr["comparisons"]["vllm"]
    assert c["win"] and c["margin_pct"] == pytest.approx(100 * (320 / 3 - 100) / 100)
    assert (c["run_pairs"], c["run_pairs_agree"]) == (3, 2)  # run 2: 90 < 100
    assert c["agree_fraction"] == pytest.approx(2 / 3)

    ttft = p["metrics"]["median_ttft_ms"]["comparisons"]["vllm"]
    theirs = (40 + 60 + 70) / 3
    assert ttft["win"] and ttft["margin_pct"] == pytest.approx(100 * (theirs - 50) / theirs)
    assert ttft["run_pairs_agree"] == 2  # run 1: 50 > 40

    tpot = p["metrics"]["p99_tpot_ms"]["comparisons"]["vllm"]
    assert not tpot["win"] and tpot["margin_pct"] == pytest.approx(-100.0)
    assert tpot["agree_fraction"] == 1.0
    assert [f["run"] for f in sc["failed_runs"]] == [4]


def test_other_side_and_missing_target(results):
    sc = build_scorecard(results, ours="vllm")
    assert (sc["totals"]["backboard"]["wins"], sc["totals"]["backboard"]["total"]) == (22, 26)
    with pytest.raises(ValueError, match="targets found: backboard, vllm"):
        build_scorecard(results, ours="sglang")


def test_unequal_runs_pair_only_common_ones(tmp_path):
    d = str(tmp_path)
    _write(d, _result("backboard", 1, 128, 1, 10.0, lat=5.0))
    _write(d, _result("backboard", 2, 128, 1, 30.0, lat=5.0))
    _write(d, _result("vllm", 1, 128, 1, 15.0, lat=6.0))
    c = build_scorecard(d)["points"][0]["metrics"]["output_throughput"]["comparisons"]["vllm"]
    assert c["win"] and c["ours"] == 20.0  # mean of both our runs
    assert (c["run_pairs"], c["run_pairs_agree"]) == (1, 0)  # run 1: 10 < 15


def test_files_markdown_and_plots(results):
    out = os.path.join(results, "card")
    sc, paths = write_scorecard(results, ours="backboard", out_dir=out)
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["latency_percentiles.png", "scorecard.json", "scorecard.md",
                     "throughput_vs_concurrency.png", "throughput_vs_interactivity.png"]
    for p in paths:
        assert os.path.getsize(p) > 0
        if p.endswith(".png"):
            with open(p, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(os.path.join(out, "scorecard.md")).read()
    assert "backboard vs vllm: 4/26 wins" in md
    assert "WIN +6.7%, agree 2/3" in md and "loss -100.0%, agree 3/3" in md
    assert "Failed runs" in md
    assert md.startswith("# Scorecard")  # set up alike: nothing to say first
    assert "| output tok/s | 2/2 |" in md and "| TPOT p99 (ms) | 0/2 |" in md
    assert json.load(open(os.path.join(out, "scorecard.json")))["totals"] == sc["totals"]


def test_cli_scorecard(results, capsys):
    from backboard.cli import main

    assert main(["bench", "scorecard", results, "--no-plots"]) == 0
    assert "backboard vs vllm: 4/26 wins" in capsys.readouterr().out
    assert main(["bench", "scorecard", os.path.join(results, "nothing-here")]) == 2
    assert "no sweep results" in capsys.readouterr().err


def test_three_engines_are_scored_against_each_competitor(tmp_path):
    """Ours vs each competitor separately: its own tally of the 13 metrics per point. The scorecard
    starts by saying where the set-ups differ (backend and the target's note)."""
    d = str(tmp_path)
    for run in (1, 2):
        for isl in (256, 1024):
            _write(d, _result("backboard", run, isl, 1, 50.0, lat=10.0))
            _write(d, _result("vllm", run, isl, 1, 40.0, lat=20.0))  # ours wins all 13
            llama = _result("llama-cpp", run, isl, 1, 60.0, lat=5.0)  # ours loses all 13
            llama["backend"] = "openai-chat"
            llama["sweep"]["server"] = {"note": "measured through\n  the chat endpoint"}
            _write(d, llama)
    sc, paths = write_scorecard(d, ours="backboard", plots=False)
    assert sc["competitors"] == ["llama-cpp", "vllm"]
    assert {o: (t["wins"], t["total"]) for o, t in sc["totals"].items()} == {
        "vllm": (26, 26), "llama-cpp": (0, 26)}
    assert sc["setups"]["llama-cpp"] == {"backends": ["openai-chat"],
                                         "notes": ["measured through the chat endpoint"]}
    md = open(paths[0]).read()
    first = md.splitlines()[0]
    assert first.startswith("> Configurations differ:")
    assert "llama-cpp: InferenceX backend openai-chat; measured through the chat endpoint" in first
    assert "backboard: InferenceX backend vllm" in first
    assert "backboard vs llama-cpp: 0/26 wins" in md and "backboard vs vllm: 26/26 wins" in md
    assert "| output tok/s | 0/2 | 2/2 |" in md
    point = sc["points"][0]["metrics"]["median_tpot_ms"]
    assert point["means"] == {"backboard": 10.0, "llama-cpp": 5.0, "vllm": 20.0}
    assert not point["comparisons"]["llama-cpp"]["win"] and point["comparisons"]["vllm"]["win"]
