"""Build and load the C++ CPU kernels: `torch.utils.cpp_extension`, compiled on first use and
cached on disk, one build per instruction-set level.

    isa = cpu_isa()                    # "amx_bf16" | "avx512_bf16" | "avx512" | "avx2" | "portable"
    mod = load_kernels("gemm", ["gemm.cpp"], isa)    # None when no compiler: use the references

A kernel family is one or more `.cpp` files in this folder. Each ISA level compiles the same
sources with its own `-m` flags and a macro (`BB_ISA_AMX_BF16`, which also defines
`BB_ISA_AVX512_BF16`; `BB_ISA_AVX512_BF16`, `BB_ISA_AVX512`, `BB_ISA_AVX2`, `BB_ISA_PORTABLE`)
into an extension named `backboard_<family>_<isa>`, so one process can load several levels side by
side (tests run the machine's best level and the portable one). The level is chosen at run time
from the CPU's flags, never at install time: the machines this project runs on differ (AVX2-only,
AVX-512, AVX-512 with BF16, AMX).

Without a working compiler (or with BACKBOARD_CPU_KERNELS=0) `load_kernels` returns None and
logs once; callers fall back to the torch references.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SRC_DIR = Path(__file__).parent
ENV_DISABLE = "BACKBOARD_CPU_KERNELS"        # "0" / "off": never build, use torch references
ISA_ENV = "BACKBOARD_CPU_ISA"                # force a lower level than the CPU's best

# best first; each level runs on every CPU that has the flags listed
_AVX512_BF16 = (("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"),
                ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c",
                 "-mavx2"))
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # level: (CPU flags required, compiler flags)
    # amx_bf16 is avx512_bf16 (its macro too: every AVX512-BF16 kernel is in it) plus AMX tiles
    # for the bf16 GEMMs (gemm_amx.h)
    "amx_bf16": ((*_AVX512_BF16[0], "amx_tile", "amx_bf16"),
                 (*_AVX512_BF16[1], "-mamx-tile", "-mamx-bf16", "-DBB_ISA_AVX512_BF16")),
    "avx512_bf16": _AVX512_BF16,
    "avx512": (("avx512f", "avx512bw", "avx512vl", "fma"),
               ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mavx2")),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "portable": ((), ()),
}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where that file does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field ("MemTotal", "MemAvailable", ...) in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.lru_cache(maxsize=1)
def cpu_family() -> tuple[str, int]:
    """(vendor, family) from /proc/cpuinfo, e.g. ("AuthenticAMD", 26) for Zen 5; ("", -1) unknown."""
    vendor, family = "", -1
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                key, _, val = ln.partition(":")
                if key.strip() == "vendor_id" and not vendor:
                    vendor = val.strip()
                elif key.strip() == "cpu family" and family < 0:
                    family = int(val.strip())
                if vendor and family >= 0:
                    break
    except (OSError, ValueError):
        pass
    return vendor, family


@functools.lru_cache(maxsize=1)
def supported_isas() -> tuple[str, ...]:
    """Every level this CPU runs, best first ("portable" always last)."""
    flags = cpu_flags()
    return tuple(name for name, (need, _) in ISA_LEVELS.items() if all(f in flags for f in need))


def cpu_isa() -> str:
    """The best level this CPU runs (BACKBOARD_CPU_ISA=<level> forces a lower one)."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    levels = supported_isas()
    if forced:
        if forced not in levels:
            raise ValueError(f"{ISA_ENV}={forced!r}: this CPU runs {', '.join(levels)}")
        return forced
    return levels[0]


def kernels_enabled() -> bool:
    """False (logged once) when BACKBOARD_CPU_KERNELS turns the kernels off; read at every call,
    so callers can check it per call (ops/dispatch.py does)."""
    on = os.environ.get(ENV_DISABLE, "1").strip().lower() not in ("0", "off", "false", "no")
    if not on:
        _warn_once(f"{ENV_DISABLE}=0: CPU kernels disabled, running the torch references")
    return on


@functools.lru_cache(maxsize=None)
def load_kernels(family: str, sources: tuple[str, ...], isa: str | None = None) -> ModuleType | None:
    """Compile (once, cached under torch's extension directory) and import a kernel family for
    one ISA level; None (logged once) when kernels are disabled or the build fails."""
    isa = isa or cpu_isa()
    if not kernels_enabled():
        return None
    try:
        return _build(family, tuple(str(SRC_DIR / s) for s in sources), isa)
    except Exception as e:  # noqa: BLE001 - no compiler, bad toolchain: the references still run
        _report_build_failure(family, isa, e)
        return None


_build_failed = False      # the first failed build warns; the others (more families, levels) log at debug


def _report_build_failure(family: str, isa: str, e: Exception) -> None:
    """Say once per process that the CPU kernels did not build and the torch references run."""
    global _build_failed
    last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    msg = (f"could not build the {family} CPU kernels for {isa} ({type(e).__name__}: {last}); "
           "running the torch references (slower). Install a C++ compiler (g++) to fix.")
    (logger.debug if _build_failed else logger.warning)(msg)
    logger.debug("CPU kernel build failed", exc_info=True)
    _build_failed = True


def kernel_cflags(isa: str) -> list[str]:
    """The compiler flags of one ISA level's kernels."""
    return ["-O3", "-fopenmp", f"-DBB_ISA_{isa.upper()}", *ISA_LEVELS[isa][1]]


def _build(family: str, paths: tuple[str, ...], isa: str) -> ModuleType:
    from torch.utils import cpp_extension

    cflags = kernel_cflags(isa)            # the C++ standard: cpp_extension's (torch's)
    # the hash of the sources, this folder's headers and the flags is in the name: an edited
    # kernel or header never loads a stale build
    inputs = [Path(p).read_bytes() for p in paths]
    inputs += [h.read_bytes() for h in sorted(SRC_DIR.glob("*.h"))] + [" ".join(cflags).encode()]
    digest = hashlib.sha1(b"\0".join(inputs)).hexdigest()[:8]
    sources = _staged_sources(paths, digest)
    with _builder(family, isa):
        _remove_stale_locks(family, isa)
        return cpp_extension.load(name=f"backboard_{family}_{isa}_{digest}", sources=sources,
                                  extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)


def _build_root() -> Path:
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def _staged_sources(paths: tuple[str, ...], digest: str) -> list[str]:
    """Copies of the sources and headers under the build root, in a folder named by their hash.

    ninja's build file names the source paths, so building straight from this folder would
    rebuild every family for each checkout (git worktrees, a second clone) and each checkout's
    build would overwrite the other's. Identical sources share one folder and so one build."""
    stage = _build_root() / "backboard_src" / digest
    if not stage.is_dir():
        tmp = stage.with_name(f"{digest}.{os.getpid()}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for f in [Path(p) for p in paths] + sorted(SRC_DIR.glob("*.h")):
            (tmp / f.name).write_bytes(f.read_bytes())
        try:
            tmp.rename(stage)
        except OSError:         # another process staged the same sources first
            shutil.rmtree(tmp, ignore_errors=True)
    return [str(stage / Path(p).name) for p in paths]


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    logger.warning(msg)


@contextlib.contextmanager
def _builder(family: str, isa: str) -> Iterator[None]:
    """Hold the family's build lock (flock) while it builds or loads: every Backboard process does,
    and the kernel drops it when its process dies, killed mid-build included."""
    root = _build_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"backboard_{family}_{isa}.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)           # released when f closes or the process dies
        yield


def _remove_stale_locks(family: str, isa: str) -> None:
    """torch waits forever on the lock file of a build whose process was killed. Called under
    _builder, where no live Backboard build of the family holds one: each is a killed build's."""
    for lock in _build_root().glob(f"*/backboard_{family}_{isa}_*/lock"):    # <root>/py311_cpu/<name>/
        logger.warning("removing the build lock %s left by an interrupted build", lock)
        lock.unlink(missing_ok=True)
