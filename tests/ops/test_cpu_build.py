"""ops/cpu/build.py housekeeping that the kernels' users depend on."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest

from backboard.ops.cpu import build, decode_ops, gemm

SOURCES = gemm.SOURCES + decode_ops.SOURCES


def test_a_killed_builds_lock_is_removed_however_fresh(tmp_path, monkeypatch):
    """torch waits forever on the lock of a build whose process was killed, and a build restarted
    seconds later found it fresh: under the family's build lock every torch lock of the family is
    a killed build's and goes, whatever its age; other families' stay."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    locks = {}
    for name in ("backboard_fam_avx2_aaaa", "backboard_other_avx2_cccc"):
        d = tmp_path / "py311_cpu" / name
        d.mkdir(parents=True)
        locks[name] = d / "lock"
        locks[name].write_text("")
    with build._builder("fam", "avx2"):
        build._remove_stale_locks("fam", "avx2")
    assert not locks["backboard_fam_avx2_aaaa"].exists()
    assert locks["backboard_other_avx2_cccc"].exists()


def test_the_build_lock_is_held_while_a_builder_lives_and_dropped_when_it_is_killed(tmp_path, monkeypatch):
    """A second build of the family waits while the first lives (it must not take the first's torch
    lock for a stale one), and goes on once the first is killed (SIGKILL: no clean-up runs)."""
    import fcntl
    import signal

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from backboard.ops.cpu import build\n"
         "with build._builder('fam', 'avx2'):\n print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "backboard_fam_avx2.flock", "a") as f:
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=30)
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)     # free now: raises if it is not
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()


def test_two_checkouts_build_from_one_staged_copy(tmp_path, monkeypatch):
    """ninja's build file names the source paths: building from each checkout's own folder
    rebuilt every family per git worktree, each build overwriting the other's. Identical sources
    from two folders stage to one copy (so one build); an edited header to another."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    staged = []
    for checkout in ("a", "b"):
        src = tmp_path / checkout
        src.mkdir()
        (src / "k.cpp").write_text('#include "k.h"\n')
        (src / "k.h").write_text("// v1\n")
        monkeypatch.setattr(build, "SRC_DIR", src)
        staged.append(build._staged_sources((str(src / "k.cpp"),), "d1"))
    assert staged[0] == staged[1]
    stage = tmp_path / "ext" / "backboard_src" / "d1"
    assert staged[0] == [str(stage / "k.cpp")] and (stage / "k.h").read_text() == "// v1\n"
    (tmp_path / "b" / "k.h").write_text("// v2\n")
    other = build._staged_sources((str(tmp_path / "b" / "k.cpp"),), "d2")
    assert other != staged[0] and (tmp_path / "ext" / "backboard_src" / "d2" / "k.h").read_text() == "// v2\n"


@pytest.mark.parametrize("isa", list(build.ISA_LEVELS))
def test_every_levels_kernels_compile_whatever_this_cpu_runs(isa):
    """The machines differ (AVX2 only, AVX512-BF16, AMX) and each builds only the levels it runs:
    every level's kernels must still compile here, templates instantiated (g++ -fsyntax-only with
    that level's flags and torch's headers). A gemv_rows change that compiled for AVX2 broke the
    AVX512-BF16 and AMX builds this way (their Bf16Dp activations are raw __m512i vectors)."""
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]

    def compile_(source: str) -> subprocess.CompletedProcess:
        cmd = ["g++", "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=bb_syntax_check",
               *build.kernel_cflags(isa), *includes, str(build.SRC_DIR / source)]
        return subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(SOURCES, pool.map(compile_, SOURCES)))
    for source, r in results.items():
        assert r.returncode == 0, f"{source} for {isa}:\n{r.stderr[-4000:]}"
