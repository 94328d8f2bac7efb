"""GPU-path selection: per call, a Triton kernel (ops/triton/) or its torch reference.

Every entry point here has the signature of its torch reference and returns the same thing, so a
layer calls `dispatch.x(...)` and never needs to know which one ran.

Selection (`use_triton(*tensors)`), read at every call:
  BACKBOARD_KERNELS=torch   always the torch reference
  BACKBOARD_KERNELS=triton  always the Triton kernel; raises if triton cannot be imported, or if
                            the tensors are not on CUDA and TRITON_INTERPRET=1 is not set (the
                            interpreter runs kernels on CPU tensors: that is how tests run them)
  BACKBOARD_KERNELS=auto    (default, or unset) Triton when the tensors are on CUDA and triton
                            imports; the torch reference otherwise
`override("torch" | "triton" | "auto")` does the same for a scope (benchmarks, tests) and wins
over the environment.

triton is never imported when this module is imported (it is a test-only dependency on a
CPU install): the probe and the kernel modules are imported on first use.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Iterator

import torch

from backboard.ops.activation import silu_mul_ref
from backboard.ops.attention import paged_attention_decode_ref
from backboard.ops.gdn.decode import gdn_decode_ref
from backboard.ops.gdn.prefill import gdn_prefill_ref
from backboard.ops.norm import fused_add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref
from backboard.ops.quant import int4_linear_ref, int8_linear_ref
from backboard.ops.rotary import qk_norm_rope_write_kv_ref

MODES = ("auto", "triton", "torch")
ENV_VAR = "BACKBOARD_KERNELS"

_override: str | None = None
_triton_ok: bool | None = None          # cached result of the import probe


# ---- selection ---------------------------------------------------------------------------------
def kernel_mode() -> str:
    """The mode in force: the innermost override(), else $BACKBOARD_KERNELS, else "auto"."""
    if _override is not None:
        return _override
    mode = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r}: expected one of {', '.join(MODES)}")
    return mode


def interpreting() -> bool:
    """TRITON_INTERPRET is set: Triton kernels run (slowly) on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def _host_compiling() -> bool:
    """Launches are being recorded for a GPU target (ops/triton/host_compile.py): CPU tensors,
    nothing runs."""
    from backboard.ops.triton._checks import HostCompile
    return HostCompile.active


def triton_available() -> bool:
    """triton imports (probed once, lazily)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            importlib.import_module("triton")
            importlib.import_module("triton.language")
            _triton_ok = True
        except Exception:  # noqa: BLE001 - any import failure means no triton
            _triton_ok = False
    return _triton_ok


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernel should run for these input tensors (see the module docstring)."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    if mode == "triton":
        if not triton_available():
            raise RuntimeError(f"{ENV_VAR}=triton, but triton cannot be imported "
                               "(pip install triton, or use BACKBOARD_KERNELS=torch)")
        if not on_cuda and not (interpreting() or _host_compiling()):
            devs = sorted({str(t.device) for t in tensors})
            raise RuntimeError(f"{ENV_VAR}=triton with tensors on {devs}: Triton kernels need CUDA "
                               "tensors, or TRITON_INTERPRET=1 to run on the CPU")
        return True
    return on_cuda and triton_available()


@contextlib.contextmanager
def override(mode: str) -> Iterator[None]:
    """Force a mode for a scope: with dispatch.override("torch"): ..."""
    global _override
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {', '.join(MODES)}; got {mode!r}")
    prev, _override = _override, mode
    try:
        yield
    finally:
        _override = prev


def _kernels(name: str):
    """A kernel module of backboard.ops.triton, imported on first use."""
    return importlib.import_module(f"backboard.ops.triton.{name}")


# ---- dispatching entry points (same signatures as the references) -----------------------------
def gdn_decode(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
               ssm_state: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
               has_initial_state: torch.Tensor | None = None, *, num_k_heads: int,
               num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float) -> torch.Tensor:
    """See gdn_decode_ref."""
    fn = _kernels("gdn_decode").gdn_decode if use_triton(proj) else gdn_decode_ref
    return fn(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, ssm_state, src_slots,
              dst_slots, has_initial_state, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
              head_k_dim=head_k_dim, head_v_dim=head_v_dim, eps=eps)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float) -> torch.Tensor:
    """See ops.attention.paged_attention_decode_ref: q [B, L, nh, D] -> [B, L, nh, D]."""
    if use_triton(q):
        return _kernels("attention").paged_attention_decode(q, k_cache, v_cache, block_table,
                                                            seq_lens, max_seq_len, scale)
    return paged_attention_decode_ref(q, k_cache, v_cache, block_table, seq_lens, max_seq_len, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """See ops.norm.rms_norm_ref."""
    fn = _kernels("norm").rms_norm if use_triton(x) else rms_norm_ref
    return fn(x, weight, eps, zero_centered)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See fused_add_rms_norm_ref: returns (normed, x + residual)."""
    fn = _kernels("norm").fused_add_rms_norm if use_triton(x) else fused_add_rms_norm_ref
    return fn(x, residual, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """See ops.norm.gated_rms_norm_ref (x, gate [T, nh, N])."""
    fn = _kernels("norm").gated_rms_norm if use_triton(x) else gated_rms_norm_ref
    return fn(x, gate, weight, eps, out_dtype)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """See silu_mul_ref: [T, 2I] -> [T, I]."""
    return _kernels("activation").silu_mul(x) if use_triton(x) else silu_mul_ref(x)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """See ops.quant.int8_linear_ref: x [M, K] @ (int8 [N, K] * scale [N])^T -> [M, N]."""
    fn = _kernels("quant_gemm").int8_linear if use_triton(x) else int8_linear_ref
    return fn(x, q, scale, out_dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """See ops.quant.int4_linear_ref: x [M, K] @ dequant(uint8 [N, K//2], [N, K//G])^T -> [M, N]."""
    fn = _kernels("quant_gemm").int4_linear if use_triton(x) else int4_linear_ref
    return fn(x, packed, scales, group_size)


def gdn_prefill(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                ssm_state: torch.Tensor, cu_seqlens: list[int], slots: torch.Tensor,
                has_initial_state: torch.Tensor, *, num_k_heads: int, num_v_heads: int,
                head_k_dim: int, head_v_dim: int, eps: float) -> torch.Tensor:
    """See ops.gdn.prefill.gdn_prefill_ref: N prefill spans of proj [P, ...] -> [P, nv*dv]."""
    fn = _kernels("gdn_prefill").gdn_prefill if use_triton(proj) else gdn_prefill_ref
    return fn(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, ssm_state, cu_seqlens,
              slots, has_initial_state, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
              head_k_dim=head_k_dim, head_v_dim=head_v_dim, eps=eps)


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                          zero_centered: bool, positions: torch.Tensor, inv_freq: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """See ops.rotary.qk_norm_rope_write_kv_ref: returns rope(norm(q)); writes k, v to the caches."""
    fn = _kernels("rope").qk_norm_rope_write_kv if use_triton(q) else qk_norm_rope_write_kv_ref
    return fn(q, k, v, q_weight, k_weight, eps, zero_centered, positions, inv_freq, k_cache,
              v_cache, slot_mapping)
