#!/usr/bin/env python
"""The full Triton compile matrix (CI compiles a subset, tests/ops/test_triton_compile.py): every
variant the engine can launch at the 27B and tiny shapes, bf16 and fp32, every int4 group size,
the GDN block_v tuning candidates, for sm_90 and sm_100, with the pinned Triton. Writes the report
table and JSON to benchmarks/results/triton-compile-<triton version>-<date>.{txt,json}.

    python benchmarks/triton_compile_matrix.py [--workers N]     # ~400 compiles, ~15 min on 2 cores
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    import triton

    from backboard.ops.triton import compile_report
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"triton-compile-{triton.__version__}-{datetime.date.today():%Y%m%d}"
    rc = compile_report.main(["--out", f"{stem}.json", *sys.argv[1:]])
    rep = __import__("json").loads(Path(f"{stem}.json").read_text())
    Path(f"{stem}.txt").write_text(compile_report.table(rep["rows"]) + "\n")
    print(f"report: {stem}.txt")
    return rc


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET")
    sys.exit(main())
