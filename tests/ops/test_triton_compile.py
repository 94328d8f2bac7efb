"""The GPU path without a GPU: every Triton kernel variant the engine can launch, compiled for
Hopper (sm_90) and Blackwell (sm_100) with the pinned Triton (the GPU machine's) and its bundled
ptxas, and held to its kernel's budget (no local-memory spills, enough resident warps per SM);
and a simulated served run that must not compile anything new as contexts grow.

The compiles run in subprocesses (the kernels must be JIT functions, not the interpreter's that
tests/ops/conftest.py selects). The report table is printed and written to the test's tmp dir."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backboard.ops.triton.compile_report import BUDGETS, Budget, check, table
from backboard.ops.triton.gdn_decode import DEFAULT_BLOCK_V
from backboard.ops.triton.host_compile import LaunchSpec, Resources, blocks_per_sm, parse_ptxas

ROOT = Path(__file__).resolve().parents[2]
KERNEL_MODULES = ("attention", "gdn_decode", "gdn_prefill", "rope", "norm", "activation", "quant_gemm")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "BACKBOARD_KERNELS")}


def _kernel_names() -> set[str]:
    names = set()
    for m in KERNEL_MODULES:
        mod = importlib.import_module(f"backboard.ops.triton.{m}")
        names |= {n for n, v in vars(mod).items() if n.endswith("_kernel") and hasattr(v, "fn")}
    return names


def test_pinned_triton_is_the_gpu_machines():
    import triton
    assert triton.__version__.startswith("3.6."), triton.__version__


def test_every_variant_compiles_for_sm90_and_sm100_within_budget(tmp_path):
    out = tmp_path / "compile_report.json"
    r = subprocess.run([sys.executable, "-m", "backboard.ops.triton.compile_report", "--ci",
                        "--workers", str(min(4, os.cpu_count() or 1)), "--out", str(out)],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=1500)
    print(r.stdout[-20000:])
    assert out.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    (tmp_path / "compile_report.txt").write_text(table(rep["rows"]))
    bad = [row for row in rep["rows"] if not row["ok"]]
    assert not bad, table(bad)
    assert r.returncode == 0, r.stderr[-3000:]
    # every kernel of every module, at both targets and both shapes
    seen = {(row["kernel"], row["arch"], row["shape"]) for row in rep["rows"]}
    for k in _kernel_names():
        if k == "_split_k_sum_kernel":                 # split-K needs the 27B's long K
            assert (k, 90, "27b") in seen and (k, 100, "27b") in seen
            continue
        for arch, shape in ((90, "27b"), (100, "27b"), (90, "tiny")):
            assert (k, arch, shape) in seen, (k, arch, shape)
    assert {row["arch"] for row in rep["rows"]} == {90, 100}
    assert all(row["regs"] > 0 for row in rep["rows"])


def test_no_recompiles_while_serving(hybrid_model, tmp_path):
    """Triton compiles once per distinct specialisation: after one step of each kind, a run whose
    contexts grow past 2K tokens (block tables of 1 to 130 columns, groups at odd offsets of
    the step's arrays, verify rows changing, draft GEMVs at every row count) adds none."""
    out = tmp_path / "keys.json"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "ops" / "served_keys.py"), hybrid_model,
                        str(out)], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["new_keys"] == [], res["new_keys"]
    assert set(res["kernels"]) >= _kernel_names() - {"_split_k_sum_kernel"}, res["kernels"]
    assert res["launches"] > 1000


def test_launches_per_eager_step(hybrid_model, tmp_path):
    """Kernel launches of an eager step, counted on the CPU (benchmarks/launch_count.py): the
    Triton kernels of a decode step are exactly the fused ones (per layer: two fused add + norms
    and SiLU-mul; GDN: conv, recurrent step, and the gated norm unless the step fuses it (head_v_dim
    <= DEFAULT_BLOCK_V: the tiny model's 24, not the 27B's 128); attention: the q / k norm + RoPE + cache
    write prologue, decode + split reduce); a prefill chunk adds four per GDN layer (conv, chunk
    transform, chunk scan, gated norm); and the torch glue around them does not grow unnoticed
    (decode: the 33 GEMMs, the attention output gate, the embedding; mixed: the prefill
    attention, which stays torch, and one cat per mixer joining groups and spans)."""
    out = tmp_path / "launches.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "launch_count.py"), hybrid_model,
                        "--json", str(out)], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout)
    c = json.loads(out.read_text())
    dec = c["decode B=4"]
    dv = json.loads((Path(hybrid_model) / "config.json").read_text())["text_config"]["linear_value_head_dim"]
    gdn = 3 + 2 + (dv > DEFAULT_BLOCK_V)                                 # 2 norms + SiLU-mul, conv + step
    assert dec["layers"] == 8 and dec["triton"] == 1 + 6 * gdn + 2 * 6    # 6 GDN + 2 attention layers
    assert dec["torch"] <= 41, dec["torch_ops"]                         # measured: 41 (was 95)
    assert dec["torch_ops"]["mm"] == 33 and not {"cos", "sin", "cat", "index_copy_", "copy_"} & set(dec["torch_ops"])
    assert c["verify B=4 L=4"]["triton"] == dec["triton"]
    mixed = c["mixed 3 decodes + 1 prefill chunk"]
    assert mixed["triton"] == dec["triton"] + 6 * 4, mixed                # GDN prefill: 4 launches
    assert mixed["torch"] <= 69, mixed["torch_ops"]                     # measured: 69 (was 771)


# ---- the budget arithmetic ---------------------------------------------------------------------
PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_int8_linear_kernel' for 'sm_90a'
ptxas info    : Function properties for _int8_linear_kernel
    3640 bytes stack frame, 4324 bytes spill stores, 4968 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers
"""


def test_ptxas_report_and_occupancy():
    assert parse_ptxas(PTXAS_LOG) == dict(regs=32, stack=3640, spill_stores=4324, spill_loads=4968)
    with pytest.raises(ValueError, match="regs"):
        parse_ptxas("ptxas info : Compile time = 1 ms")
    assert blocks_per_sm(255, 4, 0) == 2            # 8192 registers per warp: 8 warps per SM
    assert blocks_per_sm(128, 4, 0) == 4
    assert blocks_per_sm(40, 1, 0) == 32            # the block limit
    assert blocks_per_sm(32, 4, 100 * 1024) == 2    # shared memory limits it


def test_budget_flags_spills_and_low_occupancy():
    spec = LaunchSpec("m", "_paged_attention_decode_kernel", {}, {}, {}, 4, 2, "k")
    assert BUDGETS[spec.kernel] == Budget(0, 8)
    assert check(spec, Resources(200, 0, 0, 0, 40000, 4)) == []
    assert check(spec, Resources(255, 80, 84, 80, 40000, 4))[0].startswith("spills 164")
    low = check(spec, Resources(255, 0, 0, 0, 120 * 1024, 4))        # one block of 4 warps
    assert low == ["4 warps/SM < 8"]
