"""Metric math on synthetic timestamps, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest

from backboard.bench.metrics import RequestOutput, compute_metrics, percentile_key, summarize_ms


def _outputs() -> list[RequestOutput]:
    return [
        # TPOT = (1.0 - 0.1) / (10 - 1) = 0.1 s
        RequestOutput(prompt_len=100, success=True, ttft=0.1, latency=1.0, itl=[0.1] * 9,
                      output_tokens=10),
        # one output token: no TPOT
        RequestOutput(prompt_len=50, success=True, ttft=0.3, latency=0.3, itl=[], output_tokens=1),
        # TPOT = (2.2 - 0.2) / (5 - 1) = 0.5 s
        RequestOutput(prompt_len=30, success=True, ttft=0.2, latency=2.2, itl=[0.5] * 4,
                      output_tokens=5),
        # failed: counts nowhere but in output_lens (0) and input_lens
        RequestOutput(prompt_len=70, success=False, ttft=9.0, latency=9.0, itl=[9.0],
                      output_tokens=99, error="boom"),
    ]


def test_counts_and_throughputs():
    r = compute_metrics(_outputs(), duration_s=4.0)
    assert r["completed"] == 3
    assert r["total_input_tokens"] == 180
    assert r["total_output_tokens"] == 16
    assert r["input_lens"] == [100, 50, 30, 70]
    assert r["output_lens"] == [10, 1, 5, 0]
    assert r["ttfts"] == [0.1, 0.3, 0.2, None] and r["e2els"] == [1.0, 0.3, 2.2, None]
    assert r["request_throughput"] == pytest.approx(0.75)
    assert r["output_throughput"] == pytest.approx(4.0)
    assert r["total_token_throughput"] == pytest.approx(49.0)
    assert r["duration"] == 4.0
    assert "request_goodput:" in r and r["request_goodput:"] is None


def test_ttft_stats_with_linear_percentiles():
    r = compute_metrics(_outputs(), duration_s=4.0)
    # TTFT ms: [100, 300, 200] -> sorted [100, 200, 300]; rank of p is p/100 * (n - 1)
    assert r["mean_ttft_ms"] == pytest.approx(200.0)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))  # population std
    assert r["p90_ttft_ms"] == pytest.approx(280.0)  # rank 1.8: 200 + 0.8 * 100
    assert r["p99_ttft_ms"] == pytest.approx(298.0)
    assert r["p99.9_ttft_ms"] == pytest.approx(299.8)


def test_tpot_excludes_single_token_requests():
    r = compute_metrics(_outputs(), duration_s=4.0)
    # TPOT ms: [100, 500]
    assert r["mean_tpot_ms"] == pytest.approx(300.0)
    assert r["median_tpot_ms"] == pytest.approx(300.0)
    assert r["std_tpot_ms"] == pytest.approx(200.0)
    assert r["p90_tpot_ms"] == pytest.approx(460.0)  # rank 0.9: 100 + 0.9 * 400
    assert r["p99_tpot_ms"] == pytest.approx(496.0)
    assert r["p99.9_tpot_ms"] == pytest.approx(499.6)


def test_itl_is_pooled_and_e2el():
    r = compute_metrics(_outputs(), duration_s=4.0)
    # ITL ms: nine 100s and four 500s
    assert r["mean_itl_ms"] == pytest.approx((900 + 2000) / 13)
    assert r["median_itl_ms"] == pytest.approx(100.0)
    assert r["p90_itl_ms"] == pytest.approx(500.0)  # rank 10.8 lies among the 500s
    assert r["p99.9_itl_ms"] == pytest.approx(500.0)
    # E2EL ms: [1000, 300, 2200] -> sorted [300, 1000, 2200]
    assert r["mean_e2el_ms"] == pytest.approx(3500 / 3)
    assert r["median_e2el_ms"] == pytest.approx(1000.0)
    assert r["p90_e2el_ms"] == pytest.approx(1960.0)  # rank 1.8: 1000 + 0.8 * 1200
    assert r["p99_e2el_ms"] == pytest.approx(2176.0)


def test_all_failed_gives_zeros():
    r = compute_metrics([RequestOutput(prompt_len=5, error="x")], duration_s=2.0)
    assert r["completed"] == 0 and r["total_output_tokens"] == 0
    assert r["mean_ttft_ms"] == 0.0 and r["p99_tpot_ms"] == 0.0 and r["request_throughput"] == 0.0


def test_percentile_keys_and_summary_names():
    assert [percentile_key(p) for p in (90.0, 99.0, 99.9)] == ["p90", "p99", "p99.9"]
    s = summarize_ms("x", [0.001, 0.003])
    assert list(s) == ["mean_x_ms", "median_x_ms", "std_x_ms", "p90_x_ms", "p99_x_ms",
                       "p99.9_x_ms"]
    assert s["mean_x_ms"] == pytest.approx(2.0) and s["std_x_ms"] == pytest.approx(1.0)
    assert s["p90_x_ms"] == pytest.approx(2.8)
