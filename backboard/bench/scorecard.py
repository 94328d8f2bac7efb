"""`backboard bench scorecard RESULTS_DIR`: who wins each InferenceX comparison.

Per point (input length, output length, concurrency) and metric, the mean over runs of each target.
The 13 metrics are output throughput (higher wins) and TTFT, TPOT, E2EL at mean, median (p50), p90
and p99 (lower wins). Our target wins a comparison when its mean is strictly better; the margin is
how much better, in % of the competitor's value (negative: worse). The run-pair agreement of a
comparison is the fraction of pairs (run i of ours, run i of theirs) whose own verdict is the
verdict on the means: how much the result would survive the noise.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict

import numpy as np

LATENCY_STATS = (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99"))
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL"))
# (result key, label, higher is better)
METRICS: tuple[tuple[str, str, bool], ...] = (("output_throughput", "output tok/s", True),) + tuple(
    (f"{stat}_{m}_ms", f"{label} {short} (ms)", False)
    for m, label in LATENCIES for stat, short in LATENCY_STATS)


def load_results(results_dir: str) -> tuple[dict, list[dict], dict]:
    """{(isl, osl, conc): {target: {run: result}}} of the good runs, the failed runs, and each
    target's set-up: {target: {"backends": [...], "notes": [...]}} (how the client spoke to it)."""
    points: dict = defaultdict(lambda: defaultdict(dict))
    failed = []
    setups: dict = defaultdict(lambda: {"backends": set(), "notes": set()})
    for path in sorted(glob.glob(os.path.join(results_dir, "**", "*.json"), recursive=True)):
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        s = r.get("sweep") if isinstance(r, dict) else None
        if not isinstance(s, dict):
            continue
        key = (int(s["input_len"]), int(s["output_len"]), int(s["concurrency"]))
        _note_setup(setups[s["target"]], r)
        if r.get("run_failed"):
            failed.append({"target": s["target"], "run": s["run"], "input_len": key[0],
                           "output_len": key[1], "concurrency": key[2], "failed": r.get("failed"),
                           "path": os.path.relpath(path, results_dir)})
            continue
        points[key][s["target"]][int(s["run"])] = r
    setups = {t: {k: sorted(v) for k, v in d.items()} for t, d in setups.items()}
    return {k: dict(v) for k, v in points.items()}, failed, setups


def _note_setup(setup: dict, r: dict) -> None:
    setup["backends"].add(str(r.get("backend") or "vllm"))
    server = r["sweep"].get("server")
    if isinstance(server, dict) and server.get("note"):
        setup["notes"].add(" ".join(str(server["note"]).split()))


def _better(a: float, b: float, higher: bool) -> bool:
    return a > b if higher else a < b


def margin_pct(ours: float, theirs: float, higher: bool) -> float | None:
    """How much better ours is, in % of theirs (positive: better)."""
    if theirs == 0:
        return None
    return 100.0 * ((ours - theirs) if higher else (theirs - ours)) / abs(theirs)


def compare(ours_runs: dict[int, dict], theirs_runs: dict[int, dict], key: str,
            higher: bool) -> dict:
    """Verdict on the means over runs, margin, and the run pairs that agree with the verdict."""
    ours = float(np.mean([r[key] for r in ours_runs.values()]))
    theirs = float(np.mean([r[key] for r in theirs_runs.values()]))
    win = _better(ours, theirs, higher)
    pairs = sorted(set(ours_runs) & set(theirs_runs))
    agree = sum(_better(ours_runs[i][key], theirs_runs[i][key], higher) == win for i in pairs)
    return {"win": win, "ours": ours, "theirs": theirs,
            "margin_pct": margin_pct(ours, theirs, higher), "run_pairs": len(pairs),
            "run_pairs_agree": agree,
            "agree_fraction": agree / len(pairs) if pairs else None}


def build_scorecard(results_dir: str, ours: str = "backboard") -> dict:
    points, failed, setups = load_results(results_dir)
    if not points:
        raise ValueError(f"no sweep results (*.json with a 'sweep' entry) under {results_dir}")
    targets = sorted({t for p in points.values() for t in p})
    if ours not in targets:
        raise ValueError(f"target {ours!r} has no results; targets found: {', '.join(targets)} "
                         "(choose one with --ours)")
    others = [t for t in targets if t != ours]
    totals = {o: {"wins": 0, "total": 0, "by_metric": {k: {"wins": 0, "total": 0}
                                                         for k, _, _ in METRICS}}
              for o in others}
    out_points = []
    for key in sorted(points):
        runs = points[key]
        entry = {"input_len": key[0], "output_len": key[1], "concurrency": key[2],
                 "runs": {t: sorted(runs[t]) for t in runs}, "metrics": {}}
        for mkey, label, higher in METRICS:
            means = {t: float(np.mean([r[mkey] for r in runs[t].values()])) for t in runs}
            comps = {}
            if ours in runs:
                for o in others:
                    if o in runs:
                        c = compare(runs[ours], runs[o], mkey, higher)
                        comps[o] = c
                        for tally in (totals[o], totals[o]["by_metric"][mkey]):
                            tally["wins"] += c["win"]
                            tally["total"] += 1
            entry["metrics"][mkey] = {"label": label, "higher_is_better": higher, "means": means,
                                      "comparisons": comps}
        out_points.append(entry)
    return {"ours": ours, "targets": targets, "competitors": others, "totals": totals,
            "setups": {t: setups.get(t, {"backends": ["vllm"], "notes": []}) for t in targets},
            "points": out_points, "failed_runs": failed}


def setup_differences(sc: dict) -> str | None:
    """One line saying where the targets' set-ups differ and why (None: measured alike)."""
    setups = sc.get("setups") or {}
    backends = {t: "/".join(s["backends"]) for t, s in setups.items()}
    if len(set(backends.values())) <= 1 and not any(s["notes"] for s in setups.values()):
        return None
    parts = [f"{t}: InferenceX backend {b}" + "".join(f"; {n}" for n in setups[t]["notes"])
             for t, b in backends.items()]
    return "Configurations differ: " + ". ".join(parts) + "."


def _fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def to_markdown(sc: dict) -> str:
    ours, others, targets = sc["ours"], sc["competitors"], sc["targets"]
    differences = setup_differences(sc)
    lines = [f"> {differences}", ""] if differences else []
    lines += [f"# Scorecard: {ours} vs {', '.join(others) or '(no competitor)'}", ""]
    lines.append("A win is higher output throughput or lower latency of the mean over runs. "
                 f"Margin: how much better {ours} is, in % of the competitor (negative: "
                 "worse). Agree: run pairs (run i vs run i) whose own verdict matches.")
    lines.append("")
    for o in others:
        t = sc["totals"][o]
        lines.append(f"- **{ours} vs {o}: {t['wins']}/{t['total']} wins**")
    if not others:
        lines.append("- one target only: nothing to compare")
    lines.append("")
    if others:
        lines += _wins_by_metric(sc)
    for p in sc["points"]:
        runs = ", ".join(f"{t}: {len(r)}" for t, r in p["runs"].items())
        lines.append(f"## input {p['input_len']}, output {p['output_len']}, "
                     f"concurrency {p['concurrency']} (runs: {runs})")
        lines.append("")
        head = ["metric"] + targets + [f"vs {o}" for o in others]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for m in p["metrics"].values():
            row = [m["label"]] + [_fmt(m["means"].get(t), 2 if "TPOT" in m["label"] else 1)
                                  for t in targets]
            for o in others:
                c = m["comparisons"].get(o)
                if c is None:
                    row.append("-")
                    continue
                agree = "" if c["agree_fraction"] is None else \
                    f", agree {c['run_pairs_agree']}/{c['run_pairs']}"
                margin = "-" if c["margin_pct"] is None else f"{c['margin_pct']:+.1f}%"
                row.append(f"{'WIN' if c['win'] else 'loss'} {margin}{agree}")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if sc["failed_runs"]:
        lines.append("## Failed runs (left out)")
        lines.append("")
        for f in sc["failed_runs"]:
            lines.append(f"- {f['target']} run {f['run']}: input {f['input_len']}, concurrency "
                         f"{f['concurrency']}: {f['failed']} failed requests ({f['path']})")
        lines.append("")
    return "\n".join(lines)


def _wins_by_metric(sc: dict) -> list[str]:
    """Wins per metric against each competitor (over all points)."""
    others = sc["competitors"]
    lines = ["| metric | " + " | ".join(f"vs {o}" for o in others) + " |",
             "|" + "---|" * (len(others) + 1)]
    for mkey, label, _ in METRICS:
        cells = [sc["totals"][o]["by_metric"][mkey] for o in others]
        lines.append(f"| {label} | " + " | ".join(f"{c['wins']}/{c['total']}" for c in cells)
                     + " |")
    return lines + [""]


def write_plots(sc: dict, out_dir: str) -> list[str]:
    """The figures as PNG files in out_dir; their paths."""
    return [_save(fig, out_dir, name) for name, fig in figures(sc)]


def figures(sc: dict) -> list[tuple[str, "object"]]:
    """(file name, matplotlib figure): output throughput vs concurrency; latency percentiles;
    throughput vs interactivity. The caller saves and closes them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(p["input_len"], p["output_len"]) for p in sc["points"]})
    by_shape = {s: [p for p in sc["points"] if (p["input_len"], p["output_len"]) == s]
                for s in shapes}
    colors = {t: f"C{i}" for i, t in enumerate(sc["targets"])}

    def series(pts, t, key):
        xs = [p["concurrency"] for p in pts if t in p["metrics"][key]["means"]]
        ys = [p["metrics"][key]["means"][t] for p in pts if t in p["metrics"][key]["means"]]
        return xs, ys

    concurrencies = sorted({p["concurrency"] for p in sc["points"]})

    def conc_axis(ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.minorticks_off()

    figs = []
    n = len(shapes)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        for t in sc["targets"]:
            ax.plot(*series(by_shape[s], t, "output_throughput"), "o-", color=colors[t], label=t)
        ax.set(xlabel="concurrency", ylabel="output tokens/s",
               title=f"input {s[0]} / output {s[1]}")
        conc_axis(ax)
        ax.grid(alpha=0.3)
        ax.legend()
    figs.append(("throughput_vs_concurrency.png", fig))

    styles = {"median": "-", "p90": "--", "p99": ":", "mean": "-."}
    fig, axes = plt.subplots(len(LATENCIES), n, figsize=(5 * n, 3.5 * len(LATENCIES)),
                             squeeze=False)
    for row, (m, label) in enumerate(LATENCIES):
        for col, s in enumerate(shapes):
            ax = axes[row][col]
            for t in sc["targets"]:
                for stat, short in LATENCY_STATS:
                    ax.plot(*series(by_shape[s], t, f"{stat}_{m}_ms"), styles[stat], marker=".",
                            color=colors[t], label=f"{t} {short}")
            ax.set(yscale="log", xlabel="concurrency", ylabel=f"{label} (ms)",
                   title=f"{label}, input {s[0]} / output {s[1]}")
            conc_axis(ax)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figs.append(("latency_percentiles.png", fig))

    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        for t in sc["targets"]:
            pts = [p for p in by_shape[s] if t in p["metrics"]["median_tpot_ms"]["means"]
                   and p["metrics"]["median_tpot_ms"]["means"][t] > 0]
            xs = [1000.0 / p["metrics"]["median_tpot_ms"]["means"][t] for p in pts]
            ys = [p["metrics"]["output_throughput"]["means"][t] for p in pts]
            ax.plot(xs, ys, "o-", color=colors[t], label=t)
            for p, x, y in zip(pts, xs, ys):
                ax.annotate(f"C{p['concurrency']}", (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.set(xlabel="interactivity: 1000 / median TPOT (tokens/s per user)",
               ylabel="output tokens/s", title=f"input {s[0]} / output {s[1]}")
        ax.grid(alpha=0.3)
        ax.legend()
    figs.append(("throughput_vs_interactivity.png", fig))
    return figs


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_scorecard(results_dir: str, ours: str | None = None) -> dict:
    """The scorecard of a results folder: built from its sweep results, or, where only the
    written scorecard was kept (committed results), read from its scorecard.json. ours: the
    target scored (None: the written scorecard's, else "backboard")."""
    written = os.path.join(results_dir, "scorecard.json")
    points = load_results(results_dir)[0]
    sc = None
    if os.path.isfile(written):
        with open(written) as f:
            sc = json.load(f)
    if not points and sc is not None:
        return sc
    return build_scorecard(results_dir, ours or (sc or {}).get("ours") or "backboard")


def write_scorecard(results_dir: str, ours: str = "backboard", out_dir: str | None = None,
                    plots: bool = True) -> tuple[dict, list[str]]:
    """Writes scorecard.md, scorecard.json and the plots; returns the scorecard and the paths."""
    sc = build_scorecard(results_dir, ours)
    out_dir = out_dir or results_dir
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "scorecard.md"), os.path.join(out_dir, "scorecard.json")]
    with open(paths[0], "w") as f:
        f.write(to_markdown(sc))
    with open(paths[1], "w") as f:
        json.dump(sc, f, indent=2)
    if plots:
        paths += write_plots(sc, out_dir)
    return sc, paths
