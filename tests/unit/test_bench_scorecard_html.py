"""The HTML scorecard: one self-contained file (no external URL, no script, plots inline) whose
tables say who wins each metric at each point, from sweep results or from a scorecard.json."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from html.parser import HTMLParser

from backboard.bench.scorecard import build_scorecard
from backboard.bench.scorecard_html import render_html, write_html
from tests.unit.test_bench_scorecard import _result, _write, results  # noqa: F401 (fixture)


class _Tables(HTMLParser):
    """Every table as rows of (text, class) cells; every img src; every tag name."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[tuple[str, str]]]] = []
        self.imgs: list[str] = []
        self.tags: set[str] = set()
        self.urls: list[str] = []
        self._cell: list | None = None

    def handle_starttag(self, tag, attrs) -> None:
        a = dict(attrs)
        self.tags.add(tag)
        self.urls += [v for k, v in attrs if k in ("src", "href", "action") and v]
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ["", a.get("class") or ""]
        elif tag == "img":
            self.imgs.append(a["src"])

    def handle_endtag(self, tag) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append((self._cell[0].strip(), self._cell[1]))
            self._cell = None

    def handle_data(self, data) -> None:
        if self._cell is not None:
            self._cell[0] += data


def _parse(text: str) -> _Tables:
    p = _Tables()
    p.feed(text)
    return p


def test_self_contained_with_plots(results):  # noqa: F811
    text = render_html(build_scorecard(results))
    p = _parse(text)
    outside = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", text)
    assert not re.search(r"(https?:)?//[a-z0-9]", outside, re.I), "no URL may point outside the file"
    assert not {"script", "link", "iframe"} & p.tags
    assert [u for u in p.urls if not u.startswith("data:image/png;base64,")] == []
    assert len(p.imgs) == 3
    for src in p.imgs:
        png = base64.b64decode(src.split(",", 1)[1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_wins_and_losses_per_metric_and_point(results):  # noqa: F811
    text = render_html(build_scorecard(results), plots=False)
    assert "backboard vs vllm: 4/26 wins" in text
    grid, *points = _parse(text).tables
    assert [c for c, _ in grid[0]] == ["metric", "in 128 / out 64 / C4", "in 512 / out 64 / C4", "wins"]
    rows = {r[0][0]: r[1:] for r in grid[1:]}
    assert len(rows) == 13
    thr = rows["output tok/s"]
    assert [cls for _, cls in thr[:2]] == ["win", "win"] and thr[0][0] == "WIN +6.7%" and thr[2][0] == "2/2"
    assert rows["TTFT p50 (ms)"][2][0] == "2/2"
    tpot = rows["TPOT p99 (ms)"]
    assert [cls for _, cls in tpot[:2]] == ["loss", "loss"] and tpot[0][0] == "loss -100.0%" and tpot[2][0] == "0/2"
    # one table per point: means of each target and the verdict with run-pair agreement
    assert len(points) == 2
    head, *body = points[0]
    assert [c for c, _ in head] == ["metric", "backboard", "vllm", "vs vllm"]
    by_metric = {r[0][0]: r for r in body}
    assert by_metric["output tok/s"][1][0] == "106.7" and by_metric["output tok/s"][2][0] == "100.0"
    assert by_metric["output tok/s"][3] == ("WIN +6.7%, agree 2/3", "win")
    assert by_metric["E2EL mean (ms)"][3] == ("loss -100.0%, agree 3/3", "loss")
    assert "Failed runs" in text and "backboard run 4" in text


def test_names_are_escaped(tmp_path):
    d = str(tmp_path)
    _write(d, _result("backboard", 1, 128, 1, 10.0, lat=5.0))
    _write(d, _result("<img src=x onerror=alert(1)>", 1, 128, 1, 15.0, lat=6.0))
    text = render_html(build_scorecard(d), plots=False)
    assert "<img src=x" not in text and "&lt;img src=x onerror=alert(1)&gt;" in text


def test_cli_html_from_results_and_from_scorecard_json(results, tmp_path, capsys):  # noqa: F811
    from backboard.cli import main

    out = str(tmp_path / "out")
    assert main(["bench", "scorecard", results, "--out-dir", out, "--html"]) == 0
    assert os.path.join(out, "scorecard.html") in capsys.readouterr().out
    first = _parse(open(os.path.join(out, "scorecard.html")).read())
    # a committed results folder keeps scorecard.json (and notes) but not the raw runs
    kept = tmp_path / "kept"
    kept.mkdir()
    shutil.copy(os.path.join(out, "scorecard.json"), kept)
    (kept / "README.md").write_text("# A test sweep\n\nmeasured on <nothing>\n")
    assert main(["bench", "scorecard", str(kept), "--html"]) == 0
    assert "backboard vs vllm: 4/26 wins" in capsys.readouterr().out
    text = open(kept / "scorecard.html").read()
    again = _parse(text)
    assert again.tables == first.tables and len(again.imgs) == 3
    assert "measured on &lt;nothing&gt;" in text
    vllm = json.load(open(kept / "scorecard.json"))["totals"]["vllm"]
    assert (vllm["wins"], vllm["total"]) == (4, 26)
    assert write_html(str(kept), plots=False).endswith("scorecard.html")
