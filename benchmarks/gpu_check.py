#!/usr/bin/env python
"""One prepared GPU check for the decode kernels (issue 7): correctness at realistic shapes, then
timings of Qwen3.5-27B steps against their floors and against plain PyTorch eager.

    python benchmarks/gpu_check.py                 # on one H200, under 8 minutes
    python benchmarks/gpu_check.py --smoke         # CPU, tiny shapes, TRITON_INTERPRET=1, < 1 min

Sections (results are written after each one, so a late failure loses nothing):
  calibrate  measured copy bandwidth (device-to-device copy, bytes read + written) and bf16 matmul
             rate: the denominators of the floors.
  checks     every Triton kernel against its torch reference at the 27B shapes (GDN decode and
             verify, paged decode attention at 8K contexts, norms, SiLU-mul, int8 / int4 GEMV),
             and the whole kernel-path forward against the model's eager forward on a 4-layer
             model of 27B width (prefill, decode, verify).
  decode     a random-weight model with the exact Qwen3.5-27B shapes (64 layers = 48 GDN + 16
             attention, BF16), one decode step (forward + LM head on the rows that need logits)
             at 1, 4, 16, 64 requests and a 256-row verify step (64 requests x 4 rows), with short
             and 8K contexts. Each figure next to its floor: bytes that must move (weights +
             KV read + GDN states read and written) / measured copy bandwidth.
  prefill    1K and 8K prompts, floor = FLOPs / measured matmul rate.
  graphs     the decode steps again as CUDA-graph replays (launch overhead removed).
  engine     the whole engine on the device (tiny hybrid, fp32): greedy tokens with CUDA graphs,
             eagerly, and with MTP speculation must be identical; output tok/s of each.
Paths: "eager" = the model's own forward with the torch references (dispatch forced to torch);
"kernels" = the same layer sequence calling backboard.ops.dispatch with Triton forced
(projections through torch.matmul); if the layers already call dispatch, "wired" = the model's
own forward with Triton forced. Ratios: floor / time ("floor_frac") and eager / kernels.

Output: benchmarks/results/gpu_check-<gpu name>-<date>.json (or --out DIR) and a printed table.
The sections live in benchmarks/gpucheck/ (plan, budget, kernel_path, timing, checks, bench,
engine, report); this file is the entry point (arguments, the order of the sections, the results).
Needs torch with CUDA, triton, numpy and backboard's own dependencies (msgspec for the engine section;
torch 2.11 / triton 3.6). First run on an H200: benchmarks/results/gpu_check-NVIDIA-H200-20261204-*.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU under TRITON_INTERPRET=1 (tests the script itself)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    p.add_argument("--budget-s", type=float, default=None,
                   help="every section stops starting work at its share of this many seconds "
                        "(default 420 on a GPU: the call ends within 8 minutes)")
    p.add_argument("--skip-graphs", action="store_true", help="no CUDA-graph section")
    p.add_argument("--skip-eager-8k", action="store_true",
                   help="do not time the eager path with 8K contexts (the most memory-hungry runs)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"          # before anything imports triton
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpucheck.bench import Bench, param_bytes  # noqa: E402
from benchmarks.gpucheck.budget import CLOCK, SECTION_END, Clock, skipped  # noqa: E402,F401
from benchmarks.gpucheck.checks import e2e_check, kernel_checks  # noqa: E402
from benchmarks.gpucheck.engine import engine_check, graph_fallback  # noqa: E402,F401
from benchmarks.gpucheck.plan import GB, Plan, make_plan  # noqa: E402
from benchmarks.gpucheck.report import gpu_name, print_check  # noqa: E402
from benchmarks.gpucheck.timing import calibrate  # noqa: E402


def run_timings(plan: Plan, args: argparse.Namespace, calib: dict, results: dict, save, t_start: float) -> None:
    bench = Bench(plan, calib, results, save, args.skip_eager_8k)
    results["wired"] = bench.wired
    results["model_param_bytes"] = param_bytes(bench.model)
    print(f"model: {bench.cfg.num_hidden_layers} layers, {results['model_param_bytes']['total'] / GB:.1f} GB "
          f"of weights; timing paths: {', '.join(bench.paths())}", flush=True)
    bench.decode()
    print(f"decode done at {time.time() - t_start:.0f} s", flush=True)
    bench.prefill()
    save()
    if plan.device.type == "cuda" and not args.skip_graphs:
        try:
            bench.graphs()
        except Exception as ex:  # noqa: BLE001 - graphs are the last section; report and finish
            traceback.print_exc()
            results["graphs_error"] = f"{type(ex).__name__}: {ex}"[:2000]








def main(args: argparse.Namespace) -> int:
    t_start = time.time()
    plan = make_plan(args)
    CLOCK.start(plan.budget_s, t_start)
    torch.manual_seed(0)
    name = gpu_name(plan)
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu_check-{safe}-{stamp}{'-smoke' if plan.smoke else ''}.json"
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    results: dict = dict(gpu=name, date=stamp, smoke=plan.smoke, torch=torch.__version__,
                         triton=triton_version, python=platform.python_version(),
                         shapes=plan.dims, dtype=str(plan.dtype).replace("torch.", ""),
                         notes=["floor_frac = floor / measured time; "
                                "eager_over_kernels = eager time / kernel-path time",
                                "decode floor: (weights + KV read + GDN states read and written) / copy bandwidth",
                                "prefill floor: (matmul + attention + chunked-GDN FLOPs) / measured bf16 matmul rate"])

    def save() -> None:
        results["elapsed_s"] = time.time() - t_start
        path.write_text(json.dumps(results, indent=1, default=str))

    print(f"gpu_check on {name} (torch {torch.__version__}, triton {triton_version}); results -> {path}", flush=True)
    results["calibration"] = calib = calibrate(plan)
    print(f"copy bandwidth {calib['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {calib['matmul_TFLOPs']:.1f} TFLOP/s"
          f" ({time.time() - t_start:.0f} s)", flush=True)
    save()

    checks = kernel_checks(plan, calib)
    results["checks"] = checks
    save()
    print(f"kernel checks done at {time.time() - t_start:.0f} s", flush=True)
    for name, check in (("e2e", e2e_check), ("engine", engine_check)):
        if CLOCK.past(name):
            checks.append(skipped(name, name))
            continue
        try:
            checks += check(plan)
        except Exception as e:  # noqa: BLE001 - record the failure, keep the other results
            if plan.smoke:
                raise
            traceback.print_exc()
            checks.append(dict(name=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
    results["checks"] = checks
    save()
    print(f"checks done at {time.time() - t_start:.0f} s", flush=True)
    for ck in checks:
        print_check(ck)
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()

    try:
        run_timings(plan, args, calib, results, save, t_start)
    except Exception as ex:  # noqa: BLE001 - keep the checks and whatever was timed
        if plan.smoke:
            raise
        traceback.print_exc()
        results["timings_error"] = f"{type(ex).__name__}: {ex}"[:2000]
    ok = all(ck["ok"] is not False for ck in checks)
    results["all_checks_ok"] = ok
    results["checks_skipped"] = sum(ck["ok"] is None for ck in checks)
    save()
    print(f"{'all checks passed' if ok else 'SOME CHECKS FAILED'}; {time.time() - t_start:.0f} s; {path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
