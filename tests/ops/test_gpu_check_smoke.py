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
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    files = list(tmp_path.glob("gpu_check-*-smoke.json"))
    assert len(files) == 1, files
    res = json.loads(files[0].read_text())
    assert res["all_checks_ok"] and res["smoke"] and res["checks_skipped"] == 0
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


def _gpu_check_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod                 # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_graph_fallback_fails_the_engine_check_and_the_budget_covers_every_section():
    import time
    gc = _gpu_check_module()
    assert gc.graph_fallback("graphs", on_gpu=True, graphs=False).startswith("CUDA graph capture failed")
    assert gc.graph_fallback("graphs+mtp k=3", on_gpu=True, graphs=False)
    assert gc.graph_fallback("graphs", on_gpu=True, graphs=True) is None
    assert gc.graph_fallback("eager", on_gpu=True, graphs=False) is None
    assert gc.graph_fallback("graphs", on_gpu=False, graphs=False) is None      # no graphs on a CPU
    clock = gc.Clock(100.0, t0=time.time() - 60)
    assert clock.past("checks") and clock.past("engine") and not clock.past("decode")
    assert set(gc.SECTION_END) == {"checks", "e2e", "engine", "decode", "prefill", "graphs"}
    assert max(gc.SECTION_END.values()) == 1.0
