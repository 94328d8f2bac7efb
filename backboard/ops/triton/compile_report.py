"""Compile every Triton kernel variant the engine can launch for Hopper (sm_90) and Blackwell
(sm_100) on a machine without a GPU, and hold each to its resource budget.

    python -m backboard.ops.triton.compile_report                      # 27B + tiny shapes, sm_90 + sm_100
    python -m backboard.ops.triton.compile_report --shapes 27b --arch 90 --out report.json
    python -m backboard.ops.triton.compile_report --ci                 # CI's subset (CI_PLAN)

The variants are the distinct specialisations that variants.launch_all records through the real
launchers (host_compile.recording); each is compiled with the installed Triton (pinned to the GPU
machine's version in pyproject's test extra) and its bundled ptxas. A variant fails on a compile
error, on spilling more than its kernel's budget, or on registers / shared memory that leave fewer
resident warps per SM than its kernel requires. The report (printed, and JSON with --out) lists
registers, stack, spills, shared memory and occupancy per variant. Exit status 1 when any fails.

Run it in a process of its own: the kernel modules must be imported without TRITON_INTERPRET."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

ARCHS = (90, 100)
SMS = {90: 132, 100: 148}                      # H100/H200, B200: splits are planned per target


@dataclass(frozen=True)
class Budget:
    """Most spill bytes per thread (stores + loads) and fewest resident warps per SM."""

    max_spill: int = 0
    min_warps: int = 8


# the decode kernels stream weights / KV / states: they need warps in flight to hide latency
BUDGETS = {
    "_paged_attention_decode_kernel": Budget(0, 8),
    "_paged_attention_reduce_kernel": Budget(0, 16),
    "_gdn_decode_conv_kernel": Budget(0, 16),
    "_gdn_decode_recurrent_kernel": Budget(0, 8),
    "_gated_rms_norm_kernel": Budget(0, 16),
    "_rms_norm_kernel": Budget(0, 16),
    "_silu_mul_kernel": Budget(0, 16),
    "_int8_linear_kernel": Budget(0, 8),
    "_int4_linear_kernel": Budget(0, 8),
    # prefill: compute-bound tiles (8 warps, one block per SM at the 27B shapes)
    "_qk_norm_rope_kv_kernel": Budget(0, 16),
    "_gdn_prefill_conv_kernel": Budget(0, 8),
    "_gdn_chunk_prep_kernel": Budget(0, 8),
    "_gdn_chunk_scan_kernel": Budget(0, 8),
}


# CI's subset (tests/ops/test_triton_compile.py): the engine's default launches at the 27B shapes
# in bf16 and fp32 for both targets, and at the tiny test shapes in bf16 for sm_90 (every kernel
# and every fix; the full matrix, with block_v tuning and every int4 group size, is
# benchmarks/triton_compile_matrix.py)
CI_PLAN = (("27b", (90, 100), ("bfloat16", "float32")), ("tiny", (90,), ("bfloat16",)))


def record(shape_name: str, arch: int, families: tuple[str, ...] | None = None, full: bool = True,
           dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> list[tuple]:
    """(shape name, LaunchSpec) of every distinct code variant at those shapes for sm_<arch>."""
    import torch

    from backboard.ops.triton import variants
    from backboard.ops.triton.host_compile import recording
    with recording(arch, SMS[arch]) as rec:
        variants.launch_all(variants.SHAPES[shape_name], dtypes=[getattr(torch, d) for d in dtypes],
                            families=families or tuple(variants.FAMILIES), full=full)
    return [(shape_name, spec) for spec in distinct_code(rec.specs.values())]


def distinct_code(specs) -> list:
    """One spec per distinct code: kernel, argument types, constexprs, warps and stages (the first
    seen, i.e. aligned, of specialisations that differ only in int / alignment hints)."""
    seen = {}
    for s in specs:
        key = (s.kernel, tuple(s.signature.values()), tuple(sorted(s.constexprs.items())),
               s.num_warps, s.num_stages)
        seen.setdefault(key, s)
    return list(seen.values())


def check(spec, res) -> list[str]:
    """Budget violations of one compiled variant (empty: within budget)."""
    b = BUDGETS.get(spec.kernel, Budget())
    bad = []
    if res.spills > b.max_spill:
        bad.append(f"spills {res.spills} B > {b.max_spill}")
    warps = res.blocks_per_sm() * spec.num_warps
    if warps < b.min_warps:
        bad.append(f"{warps} warps/SM < {b.min_warps}")
    return bad


def _compile_one(job: tuple) -> dict:
    shape, arch, spec = job
    from backboard.ops.triton.host_compile import compile_spec
    t0 = time.perf_counter()
    row = dict(shape=shape, arch=arch, kernel=spec.kernel, variant=spec.label())
    try:
        res = compile_spec(spec, arch)
    except Exception as e:  # noqa: BLE001 - a compile error is a failed row, reported
        row.update(ok=False, problems=[f"compile error: {type(e).__name__}: {str(e)[:400]}"])
    else:
        row.update(asdict(res), blocks_per_sm=res.blocks_per_sm(),
                   warps_per_sm=res.blocks_per_sm() * spec.num_warps)
        row["problems"] = check(spec, res)
        row["ok"] = not row["problems"]
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)


def compile_all(jobs: list[tuple], workers: int) -> list[dict]:
    if workers <= 1:
        return [_compile_one(j) for j in jobs]
    import multiprocessing as mp
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                             initializer=_worker_init) as ex:
        return list(ex.map(_compile_one, jobs, chunksize=1))


COLUMNS = (("shape", 5), ("arch", 4), ("regs", 4), ("stack", 6), ("spill_stores", 6),
           ("spill_loads", 6), ("shared", 7), ("warps_per_sm", 5), ("compile_s", 5))


def table(rows: list[dict]) -> str:
    head = " ".join(f"{n[:6]:>{max(w, 6)}}" for n, w in COLUMNS) + "  variant"
    lines = [head]
    for r in rows:
        cells = " ".join(f"{str(r.get(n, '-')):>{max(w, 6)}}" for n, w in COLUMNS)
        flag = "" if r["ok"] else "  <-- " + "; ".join(r["problems"])
        lines.append(f"{cells}  {r['variant']}{flag}")
    return "\n".join(lines)


def run(plan, workers: int, families: tuple[str, ...] | None = None, full: bool = True) -> dict:
    """plan: [(shape name, archs, dtype names)]."""
    t0 = time.time()
    jobs = [(shape, arch, spec) for name, archs, dts in plan for arch in archs
            for shape, spec in record(name, arch, families, full, dts)]
    t_rec = time.time() - t0
    rows = compile_all(jobs, workers)
    rows.sort(key=lambda r: (r["kernel"], r["shape"], r["variant"], r["arch"]))
    import triton
    return dict(triton=triton.__version__, plan=plan, full=full, variants=len(rows),
                failed=sum(not r["ok"] for r in rows), record_s=round(t_rec, 1),
                wall_s=round(time.time() - t0, 1), rows=rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="27b,tiny", help="comma-separated: 27b, tiny")
    p.add_argument("--arch", default=",".join(map(str, ARCHS)), help="comma-separated: 90, 100")
    p.add_argument("--families", default=None, help="comma-separated: norm, gdn, gdn_prefill, attention, quant")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--ci", action="store_true", help="CI's subset (CI_PLAN, default launches only)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=None, help="write the report as JSON here")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("compile_report: unset TRITON_INTERPRET (kernels must be compiled, not interpreted)")
    archs, dts = tuple(int(x) for x in a.arch.split(",")), tuple(a.dtypes.split(","))
    plan = CI_PLAN if a.ci else [(name, archs, dts) for name in a.shapes.split(",")]
    rep = run(plan, a.workers, tuple(a.families.split(",")) if a.families else None, full=not a.ci)
    print(table(rep["rows"]))
    print(f"triton {rep['triton']}: {rep['variants']} variants compiled ({rep['failed']} failed) in "
          f"{rep['wall_s']} s ({rep['record_s']} s recording)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 1 if rep["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
