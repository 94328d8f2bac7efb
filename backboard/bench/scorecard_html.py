"""The scorecard as one self-contained HTML file: `backboard bench scorecard DIR --html`, and the
scorecard viewer of the server's page (server/frontend.py).

Nothing in it points outside the file: the style is inline, the plots are PNGs in data: URLs, no
script. It holds the totals, a wins-and-losses grid (metric x point, per competitor), the table of
each point (means per target, verdict, margin, run-pair agreement), the plots and the failed runs.
"""

from __future__ import annotations

import base64
import html
import io
import os

from backboard.bench.scorecard import figures, load_scorecard

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1200px;padding:12px;color:#1d232a}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;margin:.5em 0;font-size:13px}
th,td{border:1px solid #d0d7de;padding:3px 7px;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}
th{background:#f3f5f7}
td.win{background:#dff5e1;color:#11602a}td.loss{background:#fbe1e1;color:#8a1c1c}
.totals li{font-size:1.05em}
figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid #e3e7eb}
pre{white-space:pre-wrap;background:#f6f8fa;padding:8px;border-radius:4px}
.muted{color:#57606a}
"""


def _e(v: object) -> str:
    return html.escape(str(v), quote=True)


def _num(v: float | None, label: str) -> str:
    if v is None:
        return "-"
    return f"{v:,.2f}" if "TPOT" in label else f"{v:,.1f}"


def _verdict_cell(c: dict | None, detail: bool) -> str:
    if c is None:
        return "<td>-</td>"
    margin = "" if c["margin_pct"] is None else f" {c['margin_pct']:+.1f}%"
    agree = ""
    if detail and c.get("agree_fraction") is not None:
        agree = f", agree {c['run_pairs_agree']}/{c['run_pairs']}"
    cls = "win" if c["win"] else "loss"
    return f'<td class="{cls}">{"WIN" if c["win"] else "loss"}{_e(margin)}{_e(agree)}</td>'


def _point_name(p: dict) -> str:
    return f"in {p['input_len']} / out {p['output_len']} / C{p['concurrency']}"


def _totals(sc: dict) -> str:
    ours, others = sc["ours"], sc["competitors"]
    if not others:
        return "<p>One target only: nothing to compare.</p>"
    items = "".join(f"<li><b>{_e(ours)} vs {_e(o)}: {sc['totals'][o]['wins']}/"
                    f"{sc['totals'][o]['total']} wins</b></li>" for o in others)
    return f'<ul class="totals">{items}</ul>'


def _grid(sc: dict, other: str) -> str:
    """Metric x point: the verdict of ours vs `other` in each cell, wins per metric at the end."""
    points = sc["points"]
    head = "".join(f"<th>{_e(_point_name(p))}</th>" for p in points)
    rows = []
    for key, m in (points[0]["metrics"].items() if points else ()):
        cells = [p["metrics"][key]["comparisons"].get(other) for p in points]
        wins = sum(1 for c in cells if c is not None and c["win"])
        total = sum(1 for c in cells if c is not None)
        rows.append(f"<tr><td>{_e(m['label'])}</td>{''.join(_verdict_cell(c, False) for c in cells)}"
                    f"<td>{wins}/{total}</td></tr>")
    return (f"<h2>{_e(sc['ours'])} vs {_e(other)}: wins and losses per metric and point</h2>"
            f'<div class="scroll"><table><tr><th>metric</th>{head}<th>wins</th></tr>'
            f"{''.join(rows)}</table></div>")


def _point_table(sc: dict, p: dict) -> str:
    targets, others = sc["targets"], sc["competitors"]
    runs = ", ".join(f"{_e(t)}: {len(r)}" for t, r in p["runs"].items())
    head = "".join(f"<th>{_e(t)}</th>" for t in targets) + "".join(f"<th>vs {_e(o)}</th>" for o in others)
    rows = []
    for m in p["metrics"].values():
        means = "".join(f"<td>{_num(m['means'].get(t), m['label'])}</td>" for t in targets)
        verdicts = "".join(_verdict_cell(m["comparisons"].get(o), True) for o in others)
        rows.append(f"<tr><td>{_e(m['label'])}</td>{means}{verdicts}</tr>")
    return (f"<h2>input {p['input_len']}, output {p['output_len']}, concurrency {p['concurrency']}"
            f' <span class="muted">(runs: {runs})</span></h2><div class="scroll"><table>'
            f"<tr><th>metric</th>{head}</tr>{''.join(rows)}</table></div>")


def _failed(sc: dict) -> str:
    if not sc.get("failed_runs"):
        return ""
    items = "".join(f"<li>{_e(f['target'])} run {f['run']}: input {f['input_len']}, concurrency "
                    f"{f['concurrency']}: {_e(f['failed'])} failed requests ({_e(f['path'])})</li>"
                    for f in sc["failed_runs"])
    return f"<h2>Failed runs (left out)</h2><ul>{items}</ul>"


def plot_images(sc: dict) -> list[tuple[str, str]]:
    """(name, base64 PNG) of each scorecard figure."""
    import matplotlib.pyplot as plt

    out = []
    for name, fig in figures(sc):
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        out.append((name, base64.b64encode(buf.getvalue()).decode("ascii")))
    return out


def render_html(sc: dict, title: str | None = None, notes: str | None = None,
                plots: bool = True) -> str:
    """The whole report as one HTML document."""
    ours, others = sc["ours"], sc["competitors"]
    title = title or f"Scorecard: {ours} vs {', '.join(others) or '(no competitor)'}"
    parts = [f"<h1>{_e(title)}</h1>",
             "<p>A win is higher output throughput or lower latency of the mean over runs. Margin: "
             f"how much better {_e(ours)} is, in % of the competitor (negative: worse). Agree: run "
             "pairs (run i vs run i) whose own verdict matches.</p>", _totals(sc)]
    parts += [_grid(sc, o) for o in others]
    if plots and sc["points"]:
        parts.append("<h2>Plots</h2>")
        parts += [f'<figure><img alt="{_e(name)}" src="data:image/png;base64,{data}">'
                  f"<figcaption>{_e(name[:-4].replace('_', ' '))}</figcaption></figure>"
                  for name, data in plot_images(sc)]
    parts += [_point_table(sc, p) for p in sc["points"]]
    parts.append(_failed(sc))
    if notes:
        parts.append(f"<h2>Notes</h2><pre>{_e(notes)}</pre>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")


def html_report(results_dir: str, ours: str | None = None, plots: bool = True) -> str:
    """The report of a results folder (its README.md, if any, as notes); ours as load_scorecard."""
    sc = load_scorecard(results_dir, ours)
    readme = os.path.join(results_dir, "README.md")
    notes = None
    if os.path.isfile(readme):
        with open(readme, encoding="utf-8", errors="replace") as f:
            notes = f.read()
    return render_html(sc, notes=notes, plots=plots)


def write_html(results_dir: str, ours: str = "backboard", out_dir: str | None = None,
               plots: bool = True) -> str:
    """Writes scorecard.html; returns its path."""
    out_dir = out_dir or results_dir
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "scorecard.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(html_report(results_dir, ours, plots))
    return path
