"""Kernel selection: per call, a Triton kernel (ops/triton/) on CUDA, our C++ kernel (ops/cpu/) on
the CPU, or the torch reference.

Every entry point here has the signature of its torch reference and returns the same thing, so a
layer calls `dispatch.x(...)` and never needs to know which one ran.

Selection (`use_triton(*tensors)`), read at every call outside a forward; inside one
(`fixed_selection()`, entered by the model runner for each engine step and by
forward_context.set_forward_context for a forward outside one) the environment is read once at its
start, so a decode step's ~60 kernel calls do not each read it again (266 os.environ
lookups a step on the CPU benchmark checkpoint before):
  BACKBOARD_KERNELS=torch   always the torch reference
  BACKBOARD_KERNELS=triton  always the Triton kernel; raises if triton cannot be imported, or if
                            the tensors are not on CUDA and TRITON_INTERPRET=1 is not set (the
                            interpreter runs kernels on CPU tensors: that is how tests run them)
  BACKBOARD_KERNELS=auto    (default, or unset) Triton when the tensors are on CUDA and triton
                            imports; on CPU tensors our C++ kernels (below); the torch reference
                            otherwise
`override("torch" | "triton" | "auto")` does the same for a scope (benchmarks, tests) and wins
over the environment.

On CPU tensors in auto mode (`use_cpu_kernels`), entries with a C++ kernel run it when its family
built for this CPU's instruction set (ops/cpu/build.py; BACKBOARD_CPU_KERNELS=0 turns them off):
the GEMMs (ops/cpu/gemm: bf16 / int8 / int4 weights) and the fused decode ops (ops/cpu/decode_ops
on float32 / bfloat16 tensors, `use_cpu_decode_ops`). Without a compiler the torch references
run, and the build says so once. `prepare_cpu_kernels` builds both families at engine start-up.

triton is never imported when this module is imported (it is a test-only dependency on a
CPU install): the probe and the kernel modules are imported on first use.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import time
from types import ModuleType
from typing import Iterator

import torch
import torch.nn.functional as F

from backboard.ops.activation import silu_mul_ref
from backboard.ops.argmax_screen import ArgmaxScreen, build_screen, screen_candidates_ref
from backboard.ops.attention import paged_attention_decode_ref, paged_attention_prefill_ref
from backboard.ops.cache_copy import copy_slices_ref
from backboard.ops.cpu import decode_ops as cpu_ops
from backboard.ops.cpu import gemm as cpu_gemm
from backboard.ops.cpu.build import kernels_enabled, meminfo_bytes
from backboard.ops.gdn.decode import gdn_decode_ref
from backboard.ops.gdn.prefill import gdn_prefill_ref
from backboard.ops.norm import fused_add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref
from backboard.ops.quant import int4_linear_ref, int8_linear_ref
from backboard.ops.rotary import qk_norm_rope_write_kv_ref
from backboard.ops.sampling import sample_inverse_cdf_ref, sample_logits_ref

logger = logging.getLogger(__name__)

MODES = ("auto", "triton", "torch")
ENV_VAR = "BACKBOARD_KERNELS"

_override: str | None = None
_triton_ok: bool | None = None          # cached result of the import probe


class Selection:
    """What the environment says, read once: the mode, whether the C++ CPU kernels may run, and
    the GEMM family (None: not built), looked up on first use (a GPU forward never builds the CPU
    kernels); the decode ops' family is held by cpu_ops.scope(), entered with it."""

    def __init__(self) -> None:
        self.mode = _env_mode()
        self.cpu_kernels = kernels_enabled()

    @functools.cached_property
    def gemm(self) -> ModuleType | None:
        return cpu_gemm.module() if self.cpu_kernels else None


_fixed: Selection | None = None         # set for the duration of an engine step (or a lone forward)


# ---- selection ---------------------------------------------------------------------------------
@contextlib.contextmanager
def fixed_selection() -> Iterator[Selection]:
    """Read the environment once for this scope (a forward, an engine step); nested scopes keep the
    outer one."""
    global _fixed
    if _fixed is not None:
        yield _fixed
        return
    _fixed = Selection()
    try:
        with cpu_ops.scope():
            yield _fixed
    finally:
        _fixed = None


def kernel_mode() -> str:
    """The mode in force: the innermost override(), else $BACKBOARD_KERNELS (as read at the start
    of the forward, inside one), else "auto"."""
    if _override is not None:
        return _override
    return _fixed.mode if _fixed is not None else _env_mode()


def _env_mode() -> str:
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


def use_cpu_kernels(*tensors: torch.Tensor) -> bool:
    """Whether a C++ CPU kernel may run for these tensors: auto mode, all on the CPU, kernels not
    turned off. The caller still needs its family to have built (its module is not None)."""
    if kernel_mode() != "auto" or not tensors or not all(t.is_cpu for t in tensors):
        return False
    return _fixed.cpu_kernels if _fixed is not None else kernels_enabled()


def use_cpu_decode_ops(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the C++ decode op runs (called after use_triton said no): use_cpu_kernels, float32 /
    bfloat16, no autograd through them (draft-head training differentiates the norms and the MLP:
    the references do that), and the family built (compiled on first use, cached)."""
    if x.dtype not in cpu_ops.DTYPES or not use_cpu_kernels(x, *others):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in others)):
        return False
    return cpu_ops.kernels() is not None        # resolved once per fixed_selection (cpu_ops.scope)


def cpu_decode_kernels(x: torch.Tensor, weight: torch.Tensor):
    """(gemm module, decode-ops module) when a CPU decode step of these activations over bf16
    weights like `weight` runs our C++ kernels (use_cpu_decode_ops and the bf16 GEMM), else None:
    models/cpu_decode.py's condition."""
    if weight.dtype != torch.bfloat16 or not use_cpu_decode_ops(x):
        return None
    mod = _cpu_gemm(x, weight)
    return None if mod is None else (mod, cpu_ops.kernels())


def copy_slices(tensors: list[torch.Tensor], copies: list[tuple[int, int]], dim: int) -> None:
    """The prefix cache's copies (ops.cache_copy): on the CPU one C++ call for every tensor (the
    reference's two torch calls per tensor were ~0.41 ms of a SmolLM2 draft-head step with a
    partial-block hit), else the reference."""
    if not copies or not tensors:
        return
    if use_cpu_kernels(*tensors) and all(t.is_contiguous() for t in tensors) and cpu_ops.kernels() is not None:
        cpu_ops.copy_slices(tensors, copies, dim)
    else:
        copy_slices_ref(tensors, copies, dim)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) of fp32 logits [R, V] (greedy sampling): the C++ kernel on the CPU
    (torch's read the LM head's logits at ~10 GB/s: 1.6 ms of a 16-row step), else torch's."""
    if _cpu_rows(logits):
        return cpu_ops.argmax_rows(logits)
    return logits.argmax(-1)


def screen_candidates(approx: torch.Tensor, slack: torch.Tensor,
                      norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See ops.argmax_screen.screen_candidates_ref: the C++ scan on the CPU (fp32 rows,
    contiguous), else the reference."""
    if _cpu_rows(approx):
        return cpu_ops.screen_candidates(approx, slack.contiguous(), norm.contiguous())
    return screen_candidates_ref(approx, slack, norm)


def argmax_screen_rows_max(device: torch.device) -> int:
    """Rows up to which greedy decoding screens the LM head's argmax on its INT8 copy here (0:
    never): on CPUs where the INT8 GEMV beats the bf16 one (cpu_gemm.argmax_screen_rows_max)."""
    return cpu_gemm.argmax_screen_rows_max() if _cpu_kernels_on(device) else 0


def _cpu_rows(x: torch.Tensor) -> bool:
    """Whether a row-wise C++ op (argmax, the sampling draws) takes x: fp32 [R, V > 0] with
    contiguous rows, and the decode ops run."""
    return x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0 and x.stride(1) == 1 \
        and use_cpu_decode_ops(x)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """See ops.sampling.sample_inverse_cdf_ref: probs [R, V], u [R] -> token ids [R]; the C++ kernel
    on the CPU (fp32 rows, contiguous), else the reference."""
    if _cpu_rows(probs):
        return cpu_ops.sample_inverse_cdf(probs, u.to(torch.float64).contiguous())
    return sample_inverse_cdf_ref(probs, u)


def sample_logits(logits: torch.Tensor, inv_t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """See ops.sampling.sample_logits_ref: the fused C++ kernel on the CPU, else the reference."""
    if _cpu_rows(logits):
        return cpu_ops.sample_logits(logits, inv_t.float().contiguous(), u.to(torch.float64).contiguous())
    return sample_logits_ref(logits, inv_t, u)


def _cpu_kernels_on(device: torch.device) -> bool:
    """Our CPU kernels may run on this device: a CPU, auto mode, not turned off."""
    return device.type == "cpu" and kernel_mode() == "auto" and kernels_enabled()


def prepare_cpu_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """Build (first use, minutes) or load (cached) the CPU kernel families the forward will use,
    at engine start-up rather than inside its first step; logs which path runs (a failed build
    has already said so once). A no-op off the CPU or with the kernels turned off."""
    if not _cpu_kernels_on(device) or dtype not in cpu_ops.DTYPES:
        return
    t0 = time.monotonic()
    gemm, ops = cpu_gemm.module(), cpu_ops.kernels()    # GEMM: bf16 weights, int8/int4 draft heads
    if gemm is not None or ops is not None:
        logger.info("CPU kernels ready in %.1f s: GEMM %s, decode ops %s", time.monotonic() - t0,
                    gemm.isa() if gemm else "torch", ops.isa() if ops else "torch")


def warm_cpu_gemm(device: torch.device, weights: list[torch.Tensor], max_rows: int,
                  lm_head: torch.Tensor | None = None) -> None:
    """Ready the CPU GEMM (ops/cpu/gemm.py) for the model's bf16 Linear weights [N, K]. Where bf16
    is widened in registers: a K-interleaved copy of each, and of the LM head's weight, for decode's
    rows (pack_widened). Where the native path runs: a copy of each in oneDNN's layout
    (pack_native; not the LM head's, whose rows are few), and oneDNN's bf16 matmul compiled for
    their shapes at the row counts the path gives it up to max_rows (else a served prompt of a new
    length pays ~1 ms per shape, 5-7 ms with AMX). Copies only where they fit the memory left."""
    if not _cpu_kernels_on(device) or not weights:
        return
    mod = cpu_gemm.module()
    if mod is None:
        return
    decode = weights + ([lm_head] if lm_head is not None else [])
    if packed := cpu_gemm.pack_widened(decode, available_memory(), mod=mod):
        logger.info("bf16 weights K-interleaved for decode too (%.0f MiB more)", packed / 2**20)
    if not cpu_gemm.native_row_counts(max_rows, mod):
        return
    t0 = time.monotonic()
    packed = cpu_gemm.pack_native(weights, available_memory(), mod=mod)
    shapes = {tuple(w.shape) for w in weights}
    n = cpu_gemm.warm_native(shapes, max_rows, mod=mod, packed=packed > 0)
    logger.info("oneDNN bf16 matmuls: weights %s; compiled for %d (rows, shape) pairs in %.1f s",
                f"packed ({packed / 2**20:.0f} MiB more)" if packed else "not packed (no room)", n,
                time.monotonic() - t0)


def build_argmax_screen(device: torch.device, lm_head: torch.Tensor | None) -> ArgmaxScreen | None:
    """Greedy decoding's INT8 screen of a bf16 LM head [V, K] (ops/argmax_screen.py) where
    argmax_screen_rows_max says it pays and it fits the memory left as the packed copies must
    (cpu_gemm.fits); None elsewhere."""
    if lm_head is None or lm_head.dtype != torch.bfloat16 or not argmax_screen_rows_max(device):
        return None
    if not cpu_gemm.fits(lm_head.numel() + 8 * lm_head.shape[0], available_memory()):
        logger.info("no INT8 screen of the LM head for greedy rows: no room")
        return None
    t0 = time.monotonic()
    screen = build_screen(lm_head)
    if screen is not None:
        logger.info("LM head INT8 screen for greedy rows (%.0f MiB) in %.1f s", screen.nbytes / 2**20,
                    time.monotonic() - t0)
    return screen


def available_memory() -> int | None:
    """MemAvailable in bytes (None where it cannot be read)."""
    return meminfo_bytes("MemAvailable")


def int8_lm_head_rows_max(device: torch.device) -> int | None:
    """Rows up to which a draft head's INT8 LM head beats the target's bf16 one on this device
    (None: at every row count, e.g. on GPUs, where decode reads weights and int8 reads half)."""
    return cpu_gemm.int8_lm_head_rows_max() if _cpu_kernels_on(device) else None


def int4_widened_pays(device: torch.device) -> bool:
    """Whether a draft head's int4 layers should run widened to bf16 on this device (CPUs where
    bf16 is native and unpacking costs more than the bytes it saves; never on GPUs)."""
    return _cpu_kernels_on(device) and cpu_gemm.int4_widened_pays()


def _cpu_gemm(x: torch.Tensor, *weights: torch.Tensor, group_size: int | None = None):
    """The CPU GEMM module (ops/cpu/gemm.py) when it should run for these tensors, else None."""
    if not use_cpu_kernels(x, *weights):
        return None
    mod = _fixed.gemm if _fixed is not None else cpu_gemm.module()
    return mod if mod is not None and cpu_gemm.supports(x, *weights, group_size=group_size, mod=mod) else None


def _kernels(name: str):
    """A kernel module of backboard.ops.triton, imported on first use."""
    return importlib.import_module(f"backboard.ops.triton.{name}")


# ---- dispatching entry points (same signatures as the references) -----------------------------
def _cpu_gdn(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
             norm_weight: torch.Tensor) -> bool:
    """Whether the C++ GDN kernel runs: its tensors in one dtype and the decode ops usable."""
    same = conv_weight.dtype == conv_state.dtype == norm_weight.dtype == proj.dtype
    return same and use_cpu_decode_ops(proj)


def gdn_decode(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
               ssm_state: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
               has_initial_state: torch.Tensor | None = None, *, num_k_heads: int,
               num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float) -> torch.Tensor:
    """See gdn_decode_ref."""
    if use_triton(proj):
        fn = _kernels("gdn_decode").gdn_decode
    else:
        fn = cpu_ops.gdn_decode if _cpu_gdn(proj, conv_weight, conv_state, norm_weight) else gdn_decode_ref
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
    if use_cpu_decode_ops(q) and k_cache.dtype == q.dtype:
        return cpu_ops.paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens,
                                              max_seq_len, scale)
    return paged_attention_decode_ref(q, k_cache, v_cache, block_table, seq_lens, max_seq_len, scale)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table_row: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """See ops.attention.paged_attention_prefill_ref: q [L, nh, D] -> [L, nh, D]. bf16 on a CPU
    with AVX512-BF16: the C++ flash form (torch's bf16 SDPA ran at a third of the GEMMs' rate)."""
    cpu = q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16 and q.shape[-1] % 32 == 0
    if cpu and use_cpu_decode_ops(q, k_cache) and cpu_ops.has_prefill_attention():
        return cpu_ops.paged_attention_prefill(q, k_cache, v_cache, block_table_row, seq_len, scale)
    return paged_attention_prefill_ref(q, k_cache, v_cache, block_table_row, seq_len, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """See ops.norm.rms_norm_ref."""
    if use_triton(x):
        return _kernels("norm").rms_norm(x, weight, eps, zero_centered)
    fn = cpu_ops.rms_norm if weight.dtype == x.dtype and use_cpu_decode_ops(x, weight) else rms_norm_ref
    return fn(x, weight, eps, zero_centered)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See fused_add_rms_norm_ref: returns (normed, x + residual)."""
    if use_triton(x):
        return _kernels("norm").fused_add_rms_norm(x, residual, weight, eps, zero_centered)
    same = residual.dtype == weight.dtype == x.dtype
    cpu = same and use_cpu_decode_ops(x, residual, weight)
    fn = cpu_ops.fused_add_rms_norm if cpu else fused_add_rms_norm_ref
    return fn(x, residual, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """See ops.norm.gated_rms_norm_ref (x, gate [T, nh, N])."""
    if use_triton(x):
        return _kernels("norm").gated_rms_norm(x, gate, weight, eps, out_dtype)
    same = gate.dtype == weight.dtype == out_dtype == x.dtype
    fn = cpu_ops.gated_rms_norm if same and use_cpu_decode_ops(x, gate, weight) else gated_rms_norm_ref
    return fn(x, gate, weight, eps, out_dtype)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """See silu_mul_ref: [T, 2I] -> [T, I]."""
    if use_triton(x):
        return _kernels("activation").silu_mul(x)
    return cpu_ops.silu_mul(x) if use_cpu_decode_ops(x) else silu_mul_ref(x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear (x [..., K] @ weight [N, K]^T + bias -> [..., N]) in out_dtype (default x's).
    bf16 weights on the CPU: the C++ kernel (fp32 accumulation, no bf16 rounding before out_dtype)."""
    if weight.dtype == torch.bfloat16 and (mod := _cpu_gemm(x, weight)) is not None:
        return cpu_gemm.linear_bf16(x, weight, bias, out_dtype, mod=mod)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """See ops.quant.int8_linear_ref: x [M, K] @ (int8 [N, K] * scale [N])^T -> [M, N]."""
    if use_triton(x):
        return _kernels("quant_gemm").int8_linear(x, q, scale, out_dtype)
    if (mod := _cpu_gemm(x, q, scale)) is not None:
        return cpu_gemm.int8_linear(x, q, scale, out_dtype, mod=mod)
    return int8_linear_ref(x, q, scale, out_dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """See ops.quant.int4_linear_ref: x [M, K] @ dequant(uint8 [N, K//2], [N, K//G])^T -> [M, N]."""
    if use_triton(x):
        return _kernels("quant_gemm").int4_linear(x, packed, scales, group_size)
    if (mod := _cpu_gemm(x, packed, scales, group_size=group_size)) is not None:
        return cpu_gemm.int4_linear(x, packed, scales, group_size, mod=mod)
    return int4_linear_ref(x, packed, scales, group_size)


def gdn_prefill(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                ssm_state: torch.Tensor, cu_seqlens: list[int], slots: torch.Tensor,
                has_initial_state: torch.Tensor, *, num_k_heads: int, num_v_heads: int,
                head_k_dim: int, head_v_dim: int, eps: float) -> torch.Tensor:
    """See ops.gdn.prefill.gdn_prefill_ref: N prefill spans of proj [P, ...] -> [P, nv*dv]."""
    heads = dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
                 head_v_dim=head_v_dim, eps=eps)
    args = (proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, ssm_state, cu_seqlens, slots,
            has_initial_state)
    if use_triton(proj):
        return _kernels("gdn_prefill").gdn_prefill(*args, **heads)
    if _cpu_gdn(proj, conv_weight, conv_state, norm_weight):
        return _gdn_prefill_recurrent(*args, **heads)
    return gdn_prefill_ref(*args, **heads, norm=gated_rms_norm)     # the CPU kernel's norm where built


def _gdn_prefill_recurrent(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, ssm_state,
                           cu_seqlens, slots, has_initial_state, **heads) -> torch.Tensor:
    """Prefill on the CPU: each span is one request of L = its length through the C++ decode
    kernel (conv, gates, delta rule row by row on the fp32 state, gated norm; the final state
    written back to its slot). With the few value heads of a CPU-sized model the recurrence is
    cheaper than the chunked form's hundreds of small torch ops: a 256-token prompt of the CPU
    benchmark checkpoint spent half its prefill there, and a 2-token one 20 ms."""
    out = proj.new_empty(proj.shape[0], heads["num_v_heads"] * heads["head_v_dim"])
    for i in range(len(cu_seqlens) - 1):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        if e > s:
            slot = slots[i:i + 1]
            out[s:e] = cpu_ops.gdn_decode(proj[s:e], conv_weight, conv_state, A_log, dt_bias,
                                          norm_weight, ssm_state, slot, slot,
                                          has_initial_state[i:i + 1], **heads)
    return out


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                          zero_centered: bool, positions: torch.Tensor, inv_freq: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """See ops.rotary.qk_norm_rope_write_kv_ref: returns rope(norm(q)); writes k, v to the caches.
    Without norm weights (Llama, Qwen2) the Triton kernel is not used (it always norms)."""
    weights = [w for w in (q_weight, k_weight) if w is not None]
    if use_triton(q):
        fn = _kernels("rope").qk_norm_rope_write_kv if weights else qk_norm_rope_write_kv_ref
    else:
        same = len({t.dtype for t in (q, k, v, *weights, k_cache, v_cache)}) == 1
        cpu = same and inv_freq.dtype == torch.float32 and use_cpu_decode_ops(q, k, v, k_cache)
        fn = cpu_ops.qk_norm_rope_write_kv if cpu else qk_norm_rope_write_kv_ref
    return fn(q, k, v, q_weight, k_weight, eps, zero_centered, positions, inv_freq, k_cache,
              v_cache, slot_mapping)
