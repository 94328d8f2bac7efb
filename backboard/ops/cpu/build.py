"""Build and load the C++ CPU kernels: `torch.utils.cpp_extension`, compiled on first use and
cached on disk, one build per instruction-set level.

    isa = cpu_isa()                    # "avx512_bf16" | "avx512" | "avx2" | "portable"
    mod = load_kernels("gemm", ["gemm.cpp"], isa)    # None when no compiler: use the references

A kernel family is one or more `.cpp` files in this folder. Each ISA level compiles the same
sources with its own `-m` flags and a macro (`BB_ISA_AVX512_BF16`, `BB_ISA_AVX512`,
`BB_ISA_AVX2`, `BB_ISA_PORTABLE`) into an extension named `backboard_<family>_<isa>`, so one
process can load several levels side by side (tests run the machine's best level and the
portable one). The level is chosen at run time from the CPU's flags, never at install time: the
machines this project runs on differ (AVX2-only, AVX-512, AVX-512 with BF16).

Without a working compiler (or with BACKBOARD_CPU_KERNELS=0) `load_kernels` returns None and
logs once; callers fall back to the torch references.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SRC_DIR = Path(__file__).parent
ENV_DISABLE = "BACKBOARD_CPU_KERNELS"        # "0" / "off": never build, use torch references

# best first; each level runs on every CPU that has the flags listed
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # level: (CPU flags required, compiler flags)
    "avx512_bf16": (("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"),
                    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                     "-mfma", "-mf16c", "-mavx2")),
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


def supported_isas() -> list[str]:
    """Every level this CPU runs, best first ("portable" always last)."""
    flags = cpu_flags()
    return [name for name, (need, _) in ISA_LEVELS.items() if all(f in flags for f in need)]


def cpu_isa() -> str:
    """The best level this CPU runs (BACKBOARD_CPU_ISA=<level> forces a lower one)."""
    forced = os.environ.get("BACKBOARD_CPU_ISA", "").strip().lower()
    levels = supported_isas()
    if forced:
        if forced not in levels:
            raise ValueError(f"BACKBOARD_CPU_ISA={forced!r}: this CPU runs {', '.join(levels)}")
        return forced
    return levels[0]


def kernels_enabled() -> bool:
    return os.environ.get(ENV_DISABLE, "1").strip().lower() not in ("0", "off", "false", "no")


@functools.lru_cache(maxsize=None)
def load_kernels(family: str, sources: tuple[str, ...], isa: str | None = None) -> ModuleType | None:
    """Compile (once, cached under torch's extension directory) and import a kernel family for
    one ISA level; None (logged once) when kernels are disabled or the build fails."""
    isa = isa or cpu_isa()
    if not kernels_enabled():
        _warn_once(f"{ENV_DISABLE}=0: CPU kernels disabled, running the torch references")
        return None
    try:
        return _build(family, tuple(str(SRC_DIR / s) for s in sources), isa)
    except Exception as e:  # noqa: BLE001 - no compiler, bad toolchain: the references still run
        _warn_once(f"could not build the {family} CPU kernels ({type(e).__name__}: "
                   f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); "
                   "running the torch references (slower). Install a C++ compiler (g++) to fix.")
        logger.debug("CPU kernel build failed", exc_info=True)
        return None


def _build(family: str, paths: tuple[str, ...], isa: str) -> ModuleType:
    from torch.utils import cpp_extension

    _, mflags = ISA_LEVELS[isa]
    macro = f"-DBB_ISA_{isa.upper()}"
    cflags = ["-O3", "-std=c++17", "-fopenmp", macro, *mflags]
    # the sources' hash is in the name: an edited kernel never loads a stale build
    digest = hashlib.sha1(b"".join(Path(p).read_bytes() for p in paths)).hexdigest()[:8]
    return cpp_extension.load(name=f"backboard_{family}_{isa}_{digest}", sources=list(paths),
                              extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    logger.warning(msg)
