"""Argument checks shared by the kernel launchers (torch only; raises ValueError)."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


class HostCompile:
    """Set by ops.triton.host_compile.recording(): launchers accept CPU tensors (their kernels are
    specialised and recorded, never run) and plan for `num_sms` streaming multiprocessors."""

    active: bool = False
    num_sms: int = 132


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def check_tensor(op: str, name: str, t: Any, *, ndim: int | None = None,
                 shape: Sequence[int | None] | None = None,
                 dtypes: Sequence[torch.dtype] | None = None,
                 contiguous: bool = False, last_dim_contiguous: bool = False) -> None:
    """Validate one launcher argument. `shape` entries of None are not checked."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        _fail(op, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                exp = tuple("*" if s is None else s for s in shape)
                _fail(op, f"{name} must have shape {exp}, got {tuple(t.shape)} (dim {i})")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(op, f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if contiguous and not t.is_contiguous():
        _fail(op, f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
    if last_dim_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def interpreted(kernel: Any) -> bool:
    """The kernel was built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def interpreter_dot_f32(kernel: Any, dtype: torch.dtype) -> bool:
    """Whether a kernel should upcast tl.dot operands to fp32: the interpreter (triton <= 3.9)
    multiplies bf16 operands as their raw uint16 bits, so under TRITON_INTERPRET=1 the 16-bit
    dots run in fp32 (same operand values, so the same math up to accumulation order)."""
    return interpreted(kernel) and dtype != torch.float32


def check_devices(op: str, kernel: Any, **tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device, and one the kernel can run on: CUDA, or the CPU when the kernel
    was built by the interpreter (TRITON_INTERPRET=1 set before the module was imported)."""
    devs = {n: t.device for n, t in tensors.items() if t is not None}
    first = next(iter(devs.values()))
    bad = {n: str(d) for n, d in devs.items() if d != first}
    if bad:
        _fail(op, f"all tensors must be on one device; {first} vs {bad}")
    if first.type != "cuda" and not (HostCompile.active or interpreted(kernel)):
        _fail(op, f"tensors are on {first}, but Triton kernels need CUDA tensors; on a CPU, set "
                  "TRITON_INTERPRET=1 before backboard.ops.triton is imported (tests), or call the "
                  "torch reference (backboard.ops.dispatch picks it automatically)")
    return first


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 for an H100/H200; a stand-in on CPU, or
    the recorded target's count while recording launches)."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return HostCompile.num_sms if HostCompile.active else 4


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
