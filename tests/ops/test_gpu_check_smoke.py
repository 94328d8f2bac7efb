"""benchmarks/gpu_check.py end to end in --smoke mode (CPU, tiny shapes, Triton interpreter), so
the one-shot GPU script cannot rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "BACKBOARD_KERNELS"}
    env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    files = list(tmp_path.glob("gpu_check-*-smoke.json"))
    assert len(files) == 1, files
    res = json.loads(files[0].read_text())
    assert res["all_checks_ok"] and res["smoke"]
    names = {c["name"] for c in res["checks"]}
    for part in ("gdn_decode", "paged_attention", "fused_add_rms_norm", "rms_norm", "gated_rms_norm",
                 "silu_mul", "int8_linear", "int4_linear", "e2e"):
        assert any(n.startswith(part) for n in names), part
    assert res["calibration"]["copy_bandwidth_GBps"] > 0
    rows = res["decode"] + res["prefill"]
    assert any(e["name"].startswith("verify") for e in res["decode"])
    for e in rows:
        assert e["floor_ms"] > 0
        for path in ("eager", "kernels"):
            assert e[f"{path}_ms"] and e[f"{path}_ms"] > 0, (e["name"], path, e.get(f"{path}_error"))
            assert 0 < e[f"{path}_floor_frac"]
        assert e["eager_over_kernels"] > 0
