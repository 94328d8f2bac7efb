"""GPU-path selection (ops/dispatch.py): which implementation runs, and the entry points."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from backboard.ops import dispatch


class FakeCuda:
    """Stands in for a CUDA tensor (this machine has none): only what use_triton reads."""

    is_cuda = True
    device = torch.device("cuda", 0)


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "_triton_ok", True)
    return monkeypatch


def test_auto_picks_triton_on_cuda_only(env):
    assert dispatch.kernel_mode() == "auto"
    assert dispatch.use_triton(FakeCuda()) is True
    assert dispatch.use_triton(torch.zeros(1)) is False              # CPU: the torch reference
    env.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(torch.zeros(1)) is False              # the interpreter is opt-in only
    assert dispatch.use_triton(FakeCuda(), torch.zeros(1)) is False  # mixed devices: torch


def test_auto_without_triton_falls_back(env):
    env.setattr(dispatch, "_triton_ok", False)
    assert dispatch.use_triton(FakeCuda()) is False


def test_forced_modes(env):
    env.setenv("BACKBOARD_KERNELS", "torch")
    assert dispatch.use_triton(FakeCuda()) is False
    env.setenv("BACKBOARD_KERNELS", "Triton ")                       # case and spaces forgiven
    assert dispatch.use_triton(FakeCuda()) is True
    env.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(torch.zeros(1)) is True               # CPU through the interpreter
    env.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.use_triton(torch.zeros(1))
    env.setattr(dispatch, "_triton_ok", False)
    with pytest.raises(RuntimeError, match="cannot be imported"):
        dispatch.use_triton(FakeCuda())
    env.setenv("BACKBOARD_KERNELS", "cuda")
    with pytest.raises(ValueError, match="expected one of"):
        dispatch.kernel_mode()


def test_override_wins_and_nests(env):
    env.setenv("BACKBOARD_KERNELS", "torch")
    with dispatch.override("triton"):
        assert dispatch.kernel_mode() == "triton"
        with dispatch.override("auto"):
            assert dispatch.use_triton(FakeCuda()) is True
        assert dispatch.kernel_mode() == "triton"
    assert dispatch.kernel_mode() == "torch"
    with pytest.raises(ValueError):
        with dispatch.override("fast"):
            pass


def test_triton_probe_is_cached(monkeypatch):
    monkeypatch.setattr(dispatch, "_triton_ok", None)
    assert dispatch.triton_available() is True                       # triton is a test dependency
    assert dispatch._triton_ok is True


def test_entry_points_route(env):
    """Under torch the kernel modules are never touched; under triton (interpreter) they run and
    agree with the references."""
    def boom(name):
        raise AssertionError(f"kernel module {name} loaded in torch mode")

    x = torch.randn(3, 16)
    with dispatch.override("torch"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "_kernels", boom)
        torch.testing.assert_close(dispatch.silu_mul(x), dispatch.silu_mul_ref(x))
    env.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = dispatch._kernels
    env.setattr(dispatch, "_kernels", lambda name: calls.append(name) or real(name))
    w = torch.randn(16)
    with dispatch.override("triton"):
        torch.testing.assert_close(dispatch.silu_mul(x), dispatch.silu_mul_ref(x))
        out, res = dispatch.fused_add_rms_norm(x, x, w, 1e-6, True)
        ref = dispatch.fused_add_rms_norm_ref(x, x, w, 1e-6, True)
        torch.testing.assert_close(out, ref[0])
        torch.testing.assert_close(res, ref[1])
        torch.testing.assert_close(dispatch.rms_norm(x, w, 1e-6, False), dispatch.rms_norm_ref(x, w, 1e-6, False))
    assert calls == ["activation", "norm", "norm"]


def test_dispatch_does_not_import_triton():
    """On a CPU-only install triton may be absent: importing dispatch (and calling it on CPU
    tensors) must not import it."""
    code = ("import sys, torch; from backboard.ops import dispatch; "
            "x = torch.randn(2, 8); dispatch.silu_mul(x); dispatch.rms_norm(x, torch.ones(8), 1e-6, True); "
            "assert 'triton' not in sys.modules, 'triton imported'; print('ok')")
    env = {k: v for k, v in os.environ.items() if k not in ("BACKBOARD_KERNELS",)}
    env["BACKBOARD_CPU_KERNELS"] = "0"          # no C++ build inside the subprocess's timeout
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
