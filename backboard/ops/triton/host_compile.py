"""The Triton launches our launchers make, recorded and compiled for a GPU on a machine without one.

`recording(arch, num_sms)` makes Triton's active driver a compile-only stand-in and installs a JIT
cache hook, so that a launcher called with CPU tensors goes through Triton's own launch path: every
argument is specialised exactly as on a GPU (types, ints equal to 1 or divisible by 16, pointer
alignment to 16 bytes, constexprs, num_warps / num_stages), the launch is recorded as a `LaunchSpec`
under Triton's cache key, and the kernel is neither compiled nor run. One distinct key is one JIT
compilation on a real GPU, so the recorded keys are also how tests count recompilations.

`compile_spec(spec, arch)` compiles a recorded launch for sm_<arch> with the installed Triton and its
bundled ptxas (`ptxas-blackwell` for sm_100) and reads the resources ptxas reports: registers per
thread, stack frame and spill bytes, shared memory. `blocks_per_sm` turns them into occupancy.

The kernel modules must have been imported without TRITON_INTERPRET (interpreted kernels have no
specialisation): use these in a process of their own (see compile_report)."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from backboard.ops.triton._checks import HostCompile

REGS_PER_SM = 65536            # sm_90 and sm_100
SMEM_PER_SM = 228 * 1024       # bytes; each resident block also reserves 1 KiB
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32


@dataclass(frozen=True)
class LaunchSpec:
    """One distinct specialisation of a kernel (what Triton compiles once)."""

    module: str
    kernel: str
    signature: dict            # {arg name: '*bf16' | 'i32' | 'constexpr' | ...}
    constexprs: dict           # {(arg index,): value}
    attrs: dict                # {(arg index,): [['tt.divisibility', 16]]}
    num_warps: int
    num_stages: int
    key: str                   # Triton's JIT cache key

    def constexpr_values(self) -> dict[str, Any]:
        names = list(self.signature)
        return {names[i[0]]: v for i, v in self.constexprs.items()}

    def label(self) -> str:
        """The kernel and its constexprs (the parts that change the code), for reports."""
        ce = ",".join(f"{k}={v}" for k, v in self.constexpr_values().items()
                      if not isinstance(v, str) or len(v) < 8)
        dtypes = sorted({t[1:] for t in self.signature.values() if t.startswith("*") and t[1:] in
                         ("bf16", "fp32", "fp16")})
        return f"{self.kernel.lstrip('_')}[{'/'.join(dtypes)}]({ce}) w{self.num_warps}s{self.num_stages}"


@dataclass
class Recording:
    """Launches recorded so far: distinct specialisations by Triton cache key, first seen first."""

    specs: dict[str, LaunchSpec] = field(default_factory=dict)
    launches: int = 0

    def keys(self, kernel: str) -> list[str]:
        return [k for k, s in self.specs.items() if s.kernel == kernel]


class _CompileOnlyDriver:
    """Enough of a Triton driver for specialisation and compilation: a target, device 0."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[None]:
    """Triton's active driver is a compile-only one for sm_<arch> inside the block."""
    from triton.runtime.driver import driver
    prev = driver._active
    driver.set_active(_CompileOnlyDriver(arch))
    try:
        yield
    finally:
        driver._active = prev


def _spec_from_hook(key: Any, fn: Any, compile: dict) -> LaunchSpec:
    return LaunchSpec(fn.module, fn.name, dict(compile["signature"]), dict(compile["constants"]),
                      dict(compile["configs"][0]), compile["num_warps"], compile["num_stages"], str(key))


@contextlib.contextmanager
def recording(arch: int = 90, num_sms: int = 132) -> Iterator[Recording]:
    """Launchers called inside the block record their launches (CPU tensors accepted; nothing
    runs; splits are planned for `num_sms` SMs)."""
    from triton import knobs
    rec = Recording()

    def hook(*, key, fn, compile, **_):
        rec.launches += 1
        rec.specs.setdefault(str(key), _spec_from_hook(key, fn, compile))
        return True                       # skip the compile (and so the launch)

    prev_hook = knobs.runtime.jit_cache_hook
    prev_host = (HostCompile.active, HostCompile.num_sms)
    knobs.runtime.jit_cache_hook = hook
    HostCompile.active, HostCompile.num_sms = True, num_sms
    try:
        with compile_only(arch):
            yield rec
    finally:
        knobs.runtime.jit_cache_hook = prev_hook
        HostCompile.active, HostCompile.num_sms = prev_host


def jit_function(spec: LaunchSpec):
    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    if type(fn).__name__ != "JITFunction":
        raise RuntimeError(f"{spec.module}.{spec.kernel} is {type(fn).__name__}: import the kernel "
                           "modules without TRITON_INTERPRET to compile them")
    return fn


@dataclass
class Resources:
    """What ptxas reports for one compiled kernel (bytes per thread for stack and spills)."""

    regs: int
    stack: int
    spill_stores: int
    spill_loads: int
    shared: int                # bytes per block (Triton's allocation)
    num_warps: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def blocks_per_sm(self) -> int:
        return blocks_per_sm(self.regs, self.num_warps, self.shared)


def blocks_per_sm(regs: int, num_warps: int, shared: int) -> int:
    """Resident blocks per SM (sm_90 / sm_100 limits): registers are allocated per warp in units
    of 256, shared memory per block plus 1 KiB reserved."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * num_warps)
    by_smem = SMEM_PER_SM // (shared + 1024)
    return min(by_regs, by_smem, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM)


_PTXAS = {
    "regs": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def parse_ptxas(log: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from `ptxas -v` output (one kernel)."""
    out = {}
    for name, rx in _PTXAS.items():
        m = rx.search(log)
        if m is None:
            raise ValueError(f"ptxas output has no {name!r}: {log[-500:]!r}")
        out[name] = int(m.group(1))
    return out


def compile_spec(spec: LaunchSpec, arch: int) -> Resources:
    """Compile one recorded launch for sm_<arch>; raises on a compile error."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    src = ASTSource(jit_function(spec), spec.signature, spec.constexprs, spec.attrs)
    log = io.StringIO()
    prev = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    # ptxas runs (and prints its -v report) only on a cache miss: always compile
    knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True
    try:
        with compile_only(arch), contextlib.redirect_stdout(log):
            k = triton.compile(src, target=compile_only_target(arch),
                               options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = prev
    res = parse_ptxas(log.getvalue())
    return Resources(shared=int(k.metadata.shared), num_warps=spec.num_warps, **res)


def compile_only_target(arch: int):
    return _CompileOnlyDriver(arch).target
