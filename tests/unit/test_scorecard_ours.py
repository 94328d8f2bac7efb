"""A results folder whose scored target is not called "backboard" (bf16 vs fp32 Backboard) is
scored, and shown by the front end, as its written scorecard says (it failed with "target
'backboard' has no results")."""

from __future__ import annotations

import os

from backboard.bench.scorecard import load_scorecard
from backboard.bench.scorecard_html import html_report

FOLDER = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "cpu-bf16-vs-fp32-20261203")


def test_the_written_scorecards_target_is_scored():
    sc = load_scorecard(FOLDER)
    assert sc["ours"] == "backboard-bf16" and sc["competitors"] == ["backboard-fp32"]
    assert "backboard-bf16 vs backboard-fp32: 104/104 wins" in html_report(FOLDER, plots=False)
