"""The fused CPU decode ops (C++ in this folder: decode_ops.cpp and its headers), one call each
where the torch references take several: the GDN decode / verify step, paged decode attention,
RMSNorm (plain, Norm0, with the residual add), the GDN gated output norm, SiLU-mul and the
attention prologue (q / k norm, RoPE, K/V cache write), and the prefix cache's slice copies.

Every function has the signature of its torch reference and returns the same thing (to the
rounding the references do), so ops/dispatch.py swaps them in for CPU tensors:

    ops.gdn.decode.gdn_decode_ref              -> gdn_decode
    ops.attention.paged_attention_decode_ref   -> paged_attention_decode
    ops.attention.paged_attention_prefill_ref  -> paged_attention_prefill (bf16, AVX512-BF16)
    ops.norm.rms_norm_ref                      -> rms_norm
    ops.norm.fused_add_rms_norm_ref            -> fused_add_rms_norm
    ops.norm.gated_rms_norm_ref                -> gated_rms_norm
    ops.activation.silu_mul_ref                -> silu_mul
    ops.rotary.qk_norm_rope_write_kv_ref       -> qk_norm_rope_write_kv
    ops.sampling.sample_inverse_cdf_ref        -> sample_inverse_cdf
    ops.sampling.sample_logits_ref             -> sample_logits
    ops.cache_copy.copy_slices_ref             -> copy_slices (any dtype)

The extension is compiled on first use per instruction-set level (build.py); `isa=None` takes
this CPU's best level (or $BACKBOARD_CPU_ISA), tests pass a level to cover the others. Tensors
must be float32 or bfloat16 (`DTYPES`); bad arguments raise ValueError. Threads: torch's
intra-op pool (torch.set_num_threads), over (request, head) tasks.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Iterator

import torch

from backboard.ops.cpu.build import ISA_ENV, cpu_isa, load_kernels

FAMILY = "decode_ops"
SOURCES = ("decode_ops.cpp",)
DTYPES = (torch.float32, torch.bfloat16)


_by_env: dict[str | None, ModuleType | None] = {}     # $BACKBOARD_CPU_ISA -> module (hot path)
_UNSET = object()
_scope_depth = 0          # > 0 inside scope(): isa=None is resolved once (on first use) for it
_scoped: object = _UNSET


def kernels(isa: str | None = None) -> ModuleType | None:
    """The compiled extension for `isa` (None: this CPU's best level, or $BACKBOARD_CPU_ISA,
    read once per scope() and at every call outside one); None when it cannot be built (logged
    once by build.py)."""
    global _scoped
    if isa is not None:
        return load_kernels(FAMILY, SOURCES, isa)
    if _scope_depth:
        if _scoped is _UNSET:
            _scoped = _by_isa_env()
        return _scoped
    return _by_isa_env()


def _by_isa_env() -> ModuleType | None:
    key = os.environ.get(ISA_ENV)
    if key not in _by_env:
        _by_env[key] = load_kernels(FAMILY, SOURCES, cpu_isa())
    return _by_env[key]


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Inside it the environment is read once, on the first kernels() call (a GPU forward never
    makes one, so never builds them): an engine step calls the decode ops ~80 times."""
    global _scope_depth, _scoped
    _scope_depth += 1
    try:
        yield
    finally:
        _scope_depth -= 1
        if not _scope_depth:
            _scoped = _UNSET


def available(isa: str | None = None) -> bool:
    return kernels(isa) is not None


def _mod(isa: str | None) -> ModuleType:
    mod = kernels(isa)
    if mod is None:
        raise RuntimeError(f"the {FAMILY} CPU kernels are not built (see the warning logged by "
                           "backboard.ops.cpu.build); use the torch references")
    return mod


def gdn_decode(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
               ssm_state: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
               has_initial_state: torch.Tensor | None = None, *, num_k_heads: int,
               num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float,
               isa: str | None = None) -> torch.Tensor:
    """See ops.gdn.decode.gdn_decode_ref: proj [B*L, C + nv*dv + 2*nv] -> [B*L, nv*dv]; the conv
    and recurrent states of the destination slots are updated in place."""
    return _mod(isa).gdn_decode(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight,
                                ssm_state, src_slots, dst_slots, has_initial_state, num_k_heads,
                                num_v_heads, head_k_dim, head_v_dim, eps)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, *, isa: str | None = None) -> torch.Tensor:
    """See ops.attention.paged_attention_decode_ref: q [B, L, nh, D] -> [B, L, nh, D]."""
    return _mod(isa).paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens,
                                            max_seq_len, scale)


def has_prefill_attention(isa: str | None = None) -> bool:
    """Whether paged_attention_prefill is built for `isa` (VDPBF16PS or AMX tiles: the avx512_bf16
    and amx_bf16 builds)."""
    mod = kernels(isa)
    return mod is not None and mod.has_prefill_attention()


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table_row: torch.Tensor, seq_len: int, scale: float, *,
                            isa: str | None = None, use_amx: bool = True) -> torch.Tensor:
    """See ops.attention.paged_attention_prefill_ref: q [L, nh, D] bf16 (head_dim a multiple of 32),
    the last L of seq_len tokens already in the caches -> [L, nh, D]. On amx_bf16 builds the
    products run on AMX tiles (use_amx=False: on VDPBF16PS, as avx512_bf16 builds do)."""
    return _mod(isa).paged_attention_prefill(q, k_cache, v_cache, block_table_row, seq_len, scale, use_amx)


def copy_slices(tensors: list[torch.Tensor], copies: list[tuple[int, int]], dim: int, *,
                isa: str | None = None) -> None:
    """See ops.cache_copy.copy_slices_ref: (src, dst) slices along dim 0 or 1 of contiguous CPU
    tensors (any dtype), in order."""
    _mod(isa).copy_slices(list(tensors), dim, [s for s, _ in copies], [d for _, d in copies])


def argmax_rows(x: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """torch.argmax(x, -1) of fp32 logits x [R, V] (rows contiguous) -> int64 [R]."""
    return _mod(isa).argmax_rows(x)


def screen_candidates(approx: torch.Tensor, slack: torch.Tensor, norm: torch.Tensor, *,
                      isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See ops.argmax_screen.screen_candidates_ref: approx fp32 [R, N] (rows contiguous), slack
    fp32 [N], norm fp32 [R] -> (int64 [R + 1] offsets, int64 [n] indices)."""
    return _mod(isa).screen_candidates(approx, slack, norm)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """See ops.sampling.sample_inverse_cdf_ref: probs fp32 [R, V] (rows contiguous), u fp64 [R]
    -> int64 [R]."""
    return _mod(isa).sample_inverse_cdf(probs, u)


def sample_logits(logits: torch.Tensor, inv_t: torch.Tensor, u: torch.Tensor, *,
                  isa: str | None = None) -> torch.Tensor:
    """See ops.sampling.sample_logits_ref: logits fp32 [R, V] (rows contiguous), inv_t fp32 [R],
    u fp64 [R] -> int64 [R]."""
    return _mod(isa).sample_logits(logits, inv_t, u)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, *,
             isa: str | None = None) -> torch.Tensor:
    """See ops.norm.rms_norm_ref: x [..., N] -> [..., N]."""
    return _mod(isa).rms_norm(x, weight, eps, zero_centered)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered: bool, *, isa: str | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """See ops.norm.fused_add_rms_norm_ref: -> (rms_norm(x + residual), x + residual)."""
    return _mod(isa).fused_add_rms_norm(x, residual, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype, *, isa: str | None = None) -> torch.Tensor:
    """See ops.norm.gated_rms_norm_ref: x, gate [T, nh, N] -> [T, nh, N] (out_dtype must be x's)."""
    if out_dtype != x.dtype:
        raise ValueError(f"gated_rms_norm: out_dtype {out_dtype} differs from x's {x.dtype}")
    return _mod(isa).gated_rms_norm(x, gate, weight, eps)


def silu_mul(x: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """See ops.activation.silu_mul_ref: [..., 2I] -> [..., I]."""
    return _mod(isa).silu_mul(x)


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor, eps: float, zero_centered: bool,
                          positions: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          isa: str | None = None) -> torch.Tensor:
    """See ops.rotary.qk_norm_rope_write_kv_ref: q [T, nh, D], k / v [T, nkv, D] -> rope(norm(q))
    [T, nh, D]; rope(norm(k)) and v written to the caches at slot_mapping [T]."""
    return _mod(isa).qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, eps, zero_centered, positions,
                                           inv_freq, k_cache, v_cache, slot_mapping)
