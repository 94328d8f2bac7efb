"""Linear layers on narrow weights on the CPU: bf16, int8 (per channel) and int4 (grouped) weights
widened in registers, fp32 accumulation (C++: gemm.cpp; weight formats: ops/quant.py).

    y = linear_bf16(x, w, bias, out_dtype)           # x [M, K] fp32|bf16, w bf16 [N, K] -> [M, N]
    y = int8_linear(x, q, scale)                     # same contract as ops.quant.int8_linear_ref
    y = int4_linear(x, packed, scales, group_size)   # same contract as ops.quant.int4_linear_ref

Each function takes `mod=`, the compiled family for one ISA level (`module(isa)`; tests run
every level the CPU has), and picks the path by the number of rows M (POLICY):
  rows    M <= rows_max: threads over output channels, MB x NB register tiles, each weight byte
          read once per step for up to MB rows (the decode GEMV / small-M GEMM); on AVX512-BF16
          bf16 x of 16 to rows_max rows goes to the lanes kernel (gemm_lanes.h: rows in the
          vector lanes, no horizontal sums; 375-400 GFLOP/s on 2 Zen 4 cores at 64 rows, where
          the rows path reached 205 and oneDNN 280-390)
  panel   larger M (prefill): weights widened a panel at a time into fp32 scratch and multiplied
          by torch's fp32 GEMM, so prefill runs at the fp32 matmul rate with no fp32 weight copy
  native  larger M with bf16 activations on CPUs with AVX512-BF16: torch's own bf16 matmul
          (oneDNN, native bf16 dot products, fp32 accumulation), faster there than the fp32 rate;
          M padded to whole NATIVE_ROW_BLOCKs (oneDNN compiles a kernel per new M)
  packed  every row count (in the rows and panel paths' place) on a bf16 weight's K-interleaved
          copy, where the level widens bf16 in registers (PACKED_ISAS) and the runner made the
          copy (pack_widened; gemm_packed.h)
  amx     on amx_bf16 builds (AMX-BF16 CPUs) bf16 x of 4 to AMX_ROWS_MAX rows goes to AMX tiles
          (gemm_amx.h: 1.1-1.5 TFLOP/s on 2 Sapphire Rapids cores at 64 rows, where the lanes kernel
          reached 220 GFLOP/s and oneDNN 0.6-1.0); from 192 rows on oneDNN (which also uses AMX
          there) was as fast or faster, so native takes over
The thresholds come from benchmarks/cpu_kernels.py (bf16 weights, one Zen 4 core: with VDPBF16PS
the rows path matches oneDNN's bf16 matmul up to M = 64-128; the avx2 build's rows matched MKL's
fp32 GEMM up to M = 128 there and trailed the panel path by ~10% at 256). On an AVX2-only CPU, a
2-core Zen 3 without AVX-512's registers, the panel path won from 56 rows: 64-request decode steps
of the benchmark checkpoint, min / median ms of 16 interleaved, rows vs panel 207.7 / 217.2 vs
189.5 / 199.8 (in four shorter A/Bs at 56-64 requests the minimums were better every time, the
medians twice; 56 requests 204.8 / 231.9 vs 175.4 / 206.9); GEMMs alone at 48 rows even (LM head
110.5 vs 114.0 ms best of 4), at 32 rows the rows path 11-16% ahead.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from backboard.ops.cpu.build import cpu_family, cpu_isa, load_kernels, supported_isas

FAMILY, SOURCES = "gemm", ("gemm.cpp",)
X_DTYPES = (torch.float32, torch.bfloat16)

# level: (rows path up to M rows for bf16 weights, for int8/int4 weights; above: panel, or
# native for bf16 weights and bf16 activations where the CPU multiplies bf16 natively)
POLICY = {"amx_bf16": (64, 48, "native"), "avx512_bf16": (64, 48, "native"), "avx512": (48, 48, "panel"),
          "avx2": (48, 48, "panel"), "portable": (8, 8, "panel")}


def module(isa: str | None = None):
    """The compiled kernels for `isa` (default: the best level this CPU runs); None when they
    cannot be built (logged once by build.load_kernels)."""
    return _loaded(isa or cpu_isa())


@functools.lru_cache(maxsize=None)
def _loaded(isa: str):
    """The kernels of one level, set up once for this CPU (Zen 5's settings where it is one)."""
    mod = load_kernels(FAMILY, SOURCES, isa)
    if mod is not None and zen5(mod):
        mod.set_gemv_rows(*GEMV_ROWS_WIDE)
        mod.set_lanes_channels(LANES_CHANNELS_WIDE)
    if mod is not None and isa == "avx2" and supported_isas()[0] == "avx2" and cpu_family() == ZEN3:
        mod.set_gemv_rows(*GEMV_ROWS_ZEN3)
        mod.set_gemv_rows_widened(WIDENED_GEMV_ROWS)
    return mod

# gemm_gemv.h's gemv_rows (every row from one weight stream in address order) for 2 to this many
# rows over LM head-sized bf16 weights (its default min_weights / max_k) on CPUs whose best level is
# AVX2 and are AMD family 25 (Zen 3; a Zen 4 of that family runs avx512_bf16, and its avx2 build
# lost 25-44% there). Decode steps of the benchmark checkpoint on 2 Zen 3 cores, interleaved A/B,
# median ms, tiles vs this: 2 rows 18.40 -> 15.92 and 19.94 -> 17.17, 3 rows 20.45 -> 18.55 (and
# 2-4 rows over every weight was then no better than the LM head alone: GEMV_ROWS_ZEN3). 4 rows
# lost (21.65 -> 23.53) until gemv_rows kept 2 steps of K in flight there instead of 4
# (gemm_gemv.h: 4 rows x 4 steps spilled AVX2's 16 registers); since, tiles vs this at 4 rows,
# min / median of 10-12 interleaved steps: 17.23 / 20.74 -> 16.71 / 19.10 and 21.09 / 22.24 ->
# 19.32 / 20.46 ms.
WIDENED_GEMV_ROWS, ZEN3 = 4, ("AuthenticAMD", 25)
# ... and over every weight with K <= 1024, not only LM head-sized ones (max rows for the formats
# that opt in at any width, min weight elements, max K): layer-sized bf16 weights on 2 Zen 3 cores,
# 12 of each shape cycled (48+ MB, cold), us, tiles vs gemv_rows: 4 rows 4096 x 512 248 vs 208,
# 1544 x 512 81 vs 67, 512 x 512 28.5 vs 24.4; 16 rows 4096 x 512 609 vs 587, 1544 x 512 237 vs
# 214; 32 rows 4096 x 512 1226 vs 1097; 48 rows 3072 x 512 1360 vs 1229 (8 rows within 3%); K =
# 2048 lost at every row count (512 x 2048, 16 rows: 331 vs 375). Decode steps of the benchmark
# checkpoint (with gemm_gemv.h's 1 KiB prefetch), min / median ms of 10 interleaved, LM head only
# vs this: 2 requests 12.12 / 12.76 -> 11.37 / 11.71 and 11.69 / 12.76 -> 11.15 / 11.96, 3 requests
# 12.92 / 13.42 -> 12.34 / 12.65, 4, 8 and 16 requests within 2%.
GEMV_ROWS_ZEN3 = (2, 0, 1024)

# gemm.cpp's gemv_rows (one weight stream in address order feeding every row) in place of the
# register tiles for 2 to 4 bf16 rows over every bf16 weight with K <= 2048 (max rows, min weight
# elements, max K), on AMD family 26 (Zen 5), where the tiles' side-by-side reads stream slower. A
# decode step's bf16 linears of SmolLM2 (30 layers + LM head, 116 MB, cold) on 2 Zen 5 cores,
# ms, tiles vs this: 2 rows 8.7-9.4 vs 6.8, 3 rows 8.9-9.7 vs 6.6-6.9, 4 rows 7.7-9.2 vs 6.4-6.6
# (one row's GEMV 6.1; K <= 1024 only: 7.1-7.6). Elsewhere gemv_rows stays at 2 rows over LM
# head-sized weights: on a Zen 4 the tiles won at 3-4 rows over an LM head (10.4 vs 7.5 ms) and
# at K 2048+ (8192 x 2048, 2 rows: 762 vs 442 us).
GEMV_ROWS_WIDE = (4, 0, 2048)
# gemm_lanes.h's tiles at one row vector (14-16 rows) with 12 channels instead of 6 on Zen 5, whose
# two VDPBF16PS a cycle need 12 accumulator chains (figures in gemm_lanes.h: 16 rows over a 248320
# x 512 LM head 7.6 -> 5.6 ms on 2 cores).
LANES_CHANNELS_WIDE = 12


@functools.lru_cache(maxsize=8)
def zen5(mod) -> bool:
    """Whether this CPU takes Zen 5's settings, GEMV_ROWS_WIDE and LANES_CHANNELS_WIDE (measured on
    Zen 5's avx512_bf16 build only)."""
    return _isa_running(mod) == "avx512_bf16" and cpu_family() == ("AuthenticAMD", 26)


# The draft head's INT8 LM head against the target's bf16 one: int8 halves the bytes, but widening
# int8 to fp32 is arithmetic that bf16 weights skip on CPUs that multiply bf16 natively. SmolLM2's
# 49152 x 576 on 2 cores, ms int8 vs bf16 (benchmarks/draft_formats.py): Sapphire Rapids (AMX)
# 4 rows 1.16 vs 1.31, 8 rows 2.2 vs 1.3, 16 rows 4.4 vs 1.5, 64 rows 20 vs 2.7; Zen 4 (VDPBF16PS,
# no AMX) 2 rows 1.30 vs 2.16, 4 rows 1.46-1.54 vs 1.40-1.89, 8 rows 2.8 vs 1.9, 16 rows 5.6 vs 2.5,
# 64 rows 33-76 vs 9.5. Levels not listed (no native bf16) keep int8 at every row count.
INT8_LM_HEAD_ROWS_MAX = {"amx_bf16": 4, "avx512_bf16": 4}


def _isa_running(mod) -> str | None:
    """The level whose kernels run: an amx_bf16 build where the kernel refused the tile state
    runs its avx512_bf16 paths."""
    if mod is None:
        return None
    return "avx512_bf16" if mod.isa() == "amx_bf16" and not mod.amx() else mod.isa()


def int8_lm_head_rows_max(mod=None) -> int | None:
    """Rows up to which an INT8 LM head beats a bf16 one here (None: at every row count)."""
    return INT8_LM_HEAD_ROWS_MAX.get(_isa_running(mod or module()))


# Greedy decoding screens the LM head's argmax on its INT8 copy (ops/argmax_screen.py) up to this
# many rows, fewer where the INT8 head stops paying (INT8_LM_HEAD_ROWS_MAX). The benchmark
# checkpoint's 248320 x 512 head on 2 Zen 4 cores, bf16 x, median ms of 9 interleaved, bf16 vs
# INT8 GEMV: 1 row 6.45 vs 4.09, 2 rows 6.26 vs 4.18, 3 rows 6.74 vs 5.81, 4 rows 7.74 vs 6.38, 6 rows
# 6.75 vs 9.68. Not measured on AVX2-only CPUs (where INT8 heads won at every row count for drafts).
ARGMAX_SCREEN_ROWS_MAX = 4


def argmax_screen_rows_max(mod=None) -> int:
    """Rows up to which greedy decoding's argmax runs on the LM head's INT8 screen here."""
    mod = mod or module()
    if mod is None:
        return 0
    int8_max = int8_lm_head_rows_max(mod)
    return ARGMAX_SCREEN_ROWS_MAX if int8_max is None else min(int8_max, ARGMAX_SCREEN_ROWS_MAX)


# The draft head's int4 layers widened to bf16 once at load (bf16 targets): unpacking nibbles is
# arithmetic, and a draft head's weights are small (SmolLM2's: 8 MB in bf16) and come from cache.
# bf16 won at every row count, the head's 5 linears on 2 cores, ms int4 vs bf16: Sapphire Rapids
# 1 row 0.29 vs 0.21, 4 rows 0.34 vs 0.28, 16 rows 1.15 vs 0.29, 64 rows 6.2 vs 0.58; Zen 4 1 row
# 0.23 vs 0.12, 4 rows 0.35 vs 0.18, 16 rows 1.1-1.5 vs 0.35-0.56, 64 rows 6.6-11 vs 1.5.
INT4_WIDENED_ISAS = ("amx_bf16", "avx512_bf16")


def int4_widened_pays(mod=None) -> bool:
    """Whether int4 weights run faster widened to bf16 here (INT4_WIDENED_ISAS)."""
    return _isa_running(mod or module()) in INT4_WIDENED_ISAS


# bf16 x on AMX tiles up to this many rows (2 Sapphire Rapids cores, bf16 weights: 128 rows of a
# 2048 x 512 layer 0.164 vs 0.201 ms in oneDNN, 192 rows 0.258 vs 0.255, 512 rows 0.62 vs 0.47)
AMX_ROWS_MAX = 128


def _rows_max(mod, quantized: bool, x_bf16: bool = False) -> int:
    """The most rows the rows / lanes / AMX kernels take; more go to the panel or native path."""
    if x_bf16 and not quantized and mod.amx():
        return AMX_ROWS_MAX
    return POLICY[mod.isa()][int(quantized)]


def _panel(mod, M: int, quantized: bool, x_bf16: bool = False) -> bool:
    return M > _rows_max(mod, quantized, x_bf16)


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# bf16 x of these row counts over a large weight in short rows (an LM head) runs faster widened to
# fp32 (the FMA tiles) than on VDPBF16PS: Zen 4, 2 cores, us bf16 x vs fp32 x, 49152 x 576: 2 rows
# 1479 vs 840, 3 rows 1616 vs 1149 (4 rows 1121 vs 1421); 248320 x 512: 2 rows 6976 vs 6593, 3 rows
# 9359 vs 6483 (4 rows 7568 vs 6686, 5 rows 6434 vs 9201); on layer-sized weights bf16 x won by
# 1.4-1.8x. Not measured with AMX (which takes bf16 x from 4 rows).
FP32_X_ROWS = {"avx512_bf16": (2, 3)}
FP32_X_MIN_WEIGHTS, FP32_X_MAX_K = 8 << 20, 1024


def _fp32_x_rows(mod) -> tuple[int, ...]:
    """Row counts of bf16 x that may run widened to fp32 (FP32_X_ROWS; not where GEMV_ROWS_WIDE is
    set: there bf16 x of 2-3 rows over SmolLM2's 49152 x 576 took 1.11 ms in gemv_rows, widened to
    fp32 1.54-1.58, on a Zen 5)."""
    return () if zen5(mod) else FP32_X_ROWS.get(_isa_running(mod), ())


def _widen_x_pays(mod, x: torch.Tensor, w: torch.Tensor) -> bool:
    N, K = w.shape
    return (x.dtype == torch.bfloat16 and x.shape[0] in _fp32_x_rows(mod) and K <= FP32_X_MAX_K
            and N * K >= FP32_X_MIN_WEIGHTS)


def linear_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, *, mod=None) -> torch.Tensor:
    """y = x @ w^T (+ bias), x [..., K] fp32 or bf16, w bf16 [N, K] -> [..., N] in out_dtype
    (default x's dtype; fp32 or bf16)."""
    mod = mod or module()
    out_fp32 = (out_dtype or x.dtype) == torch.float32
    x2 = x if x.dim() == 2 else _rows_2d(x)
    packed = _k_packed(w, mod)
    if packed is not None:                      # at every row count
        y = mod.linear_bf16_packed(x2, packed, w.shape[0], bias, out_fp32)
    else:
        y = _by_rows(x2, w, bias, out_fp32, mod)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])


def _by_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_fp32: bool, mod) -> torch.Tensor:
    """x [M, K] on a weight without a K-interleaved copy: the path POLICY picks for M rows."""
    x_bf16 = x.dtype == torch.bfloat16
    if _widen_x_pays(mod, x, w):
        x = x.float()
    large = _panel(mod, x.shape[0], False, x_bf16)
    if large and x_bf16 and POLICY[mod.isa()][2] == "native":
        y = _native(x, w, bias, native_row_block(mod))
        return y.float() if out_fp32 else y
    return mod.linear_bf16(x, w, bias, out_fp32, large)


def decode_linear(M: int, mod):
    """linear_bf16 for a decode step's M bf16 rows on bias-free weights, as fn(x, w)
    (models/cpu_decode.py): a weight's K-interleaved copy where it has one (pack_widened), else the
    kernel called directly where linear_bf16 would call it so (the rows path, fp32 x never widened),
    else linear_bf16 itself."""
    kernel = mod.linear_bf16

    def rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernel(x, w, None, False, False)
    plain = functools.partial(linear_bf16, mod=mod) if M in _fp32_x_rows(mod) or _panel(mod, M, False, True) else rows
    packed_kernel = mod.linear_bf16_packed

    def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        packed = _k_packed(w, mod)
        return plain(x, w) if packed is None else packed_kernel(x, packed, w.shape[0])
    return lin


# gemm_packed.h: a second, K-interleaved copy of each bf16 weight, made at start-up (pack_widened)
# on the levels that widen bf16 in registers where it was measured, which every bf16 GEMM then
# runs on. Cold weights on 2 Zen 3 cores (AVX2), min ms of 10 interleaved, the rows path (gemv_rows /
# tiles) vs the packed copy: LM head 248320 x 512 at 1 row 8.27 vs 8.19, 2 rows 9.25 vs 8.92, 4 rows
# 12.46 vs 9.29, 8 rows 23.3 vs 18.0, 16 rows 43.1 vs 35.7, 48 rows 89.9 vs 78.0; 4096 x 512 at 4
# rows 0.257 vs 0.203, 16 rows 0.839 vs 0.692; 512 x 2048 at 4 rows 0.148 vs 0.106, 16 rows 0.525
# vs 0.354; 1544 x 512, 3072 x 512 and 512 x 512 ahead or even at 1-48 rows. From 49 rows in the
# panel path's place (which starts there on avx2): LM head at 49 rows 147.9 vs 111.1, 64 rows 138.6
# vs 96.8, 128 rows 226.0 vs 192.1. Prefill too, once a thread took x through its tiles a block of
# rows at a time (gemm_packed.h's X_BLOCK), panel vs copy, min ms of 4-8 interleaved (cycled copies
# of the weight, cold): 4096 x 512 at 256 rows 10.1 vs 6.8, 1024 rows 31.3 vs 26.0, 2048 rows
# 63.7 vs 53.6; 1544 x 512 at 1024 rows 11.4 vs 9.7; 3072 x 512 at 2048 rows 50.9 vs 43.3; 512 x
# 2048 at 1024 rows 17.2 vs 16.3, 2048 rows 28.4 vs 30.5 (medians 33.3 vs 31.2: even). Prefill of
# the benchmark checkpoint (forward_cpu.Ours: forward + last logits, min / median ms of 10
# interleaved), the GEMMs over 128 rows on panels vs copies: 256 tokens 202.7 / 247.0 vs 172.0 /
# 196.8, 1024 tokens 661.7 / 860.9 vs 628.0 / 773.6 (attention and GDN are more of it), 4 x 256
# 592.6 / 708.2 vs 580.8 / 696.5.
PACKED_ISAS = ("avx2",)
K_PACKED_ATTR = "_bb_k_packed"


def _k_packed(w: torch.Tensor, mod) -> torch.Tensor | None:
    """w's K-interleaved copy where it has one in this build's tile width."""
    p = getattr(w, K_PACKED_ATTR, None)
    return p if p is not None and p.shape[2] == mod.PACKED_TN else None


def packed_copies(mod=None) -> bool:
    """Whether bf16 GEMMs run on K-interleaved copies here (pack_widened makes them)."""
    mod = mod or module()
    return mod is not None and _isa_running(mod) in PACKED_ISAS


def pack_widened(weights: list[torch.Tensor], available_bytes: int | None, mod=None) -> int:
    """Give each bf16 weight [N, K] its K-interleaved copy (an attribute of the tensor, read by
    linear_bf16 and decode_linear) where this CPU's level is one of PACKED_ISAS and the copies fit
    PACK_MAX_SHARE of available_bytes. Returns the weights' bytes (0: none, all or nothing)."""
    mod = mod or module()
    if not packed_copies(mod):
        return 0
    return _pack_all(weights, available_bytes, lambda w: setattr(w, K_PACKED_ATTR, mod.pack_bf16(w.detach())))


# oneDNN builds (JIT-compiles) a kernel for every new (M, N, K): with AMX 5-7 ms per weight shape,
# 30-60 ms of a 1000-token prefill of the benchmark checkpoint (+30-60%), paid by nearly every
# served prompt since their lengths differ. The native path pads M to a multiple of a row block, so
# oneDNN only ever sees a few row counts (warm_native compiles them at start-up). With AMX the block
# is 64 rows (padding 1000 rows to 1024 cost ~2 ms of ~105; splitting off the M % 128 rest to the
# AMX kernel cost 4-8 ms, 2 SPR cores). Without AMX the compile is ~1 ms a shape and the padding was
# the cost: the benchmark checkpoint's 32 GEMMs of a 270-token prompt (InferenceX's 256-token
# prompts re-tokenized) took 24.3 ms padded to 320 rows, 20.0 ms at 270 (2 Zen 5 cores); a
# 16-row block wastes at most 15 rows and warms 4x the row counts (~6 ms each for that model).
NATIVE_ROW_BLOCK_AMX, NATIVE_ROW_BLOCK = 64, 16


def native_row_block(mod) -> int:
    return NATIVE_ROW_BLOCK_AMX if mod.amx() else NATIVE_ROW_BLOCK


def _native(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, block: int) -> torch.Tensor:
    """torch's bf16 matmul (oneDNN) on x padded with zero rows to a multiple of `block`, on w's
    packed copy where it has one (pack_native). x [M, K] bf16 -> [M, N] bf16 (a view of the padded
    product's first M rows)."""
    M, K = x.shape
    pad = -M % block
    xp = x.contiguous() if pad == 0 else torch.cat([x, x.new_zeros(pad, K)])
    packed = getattr(w, PACKED_ATTR, None)
    if packed is not None:
        y = torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")
    else:
        y = F.linear(xp, w, bias)
    return y if pad == 0 else y[:M]


# oneDNN's bf16 matmul reorders a plain weight into its blocked layout on every call; a copy kept in
# that layout (torch.ops.mkldnn._reorder_linear_weight, as inductor's frozen CPU linears use) skips
# it. The benchmark checkpoint's 32 GEMMs on 2 Zen 5 cores, ms plain vs packed, the same products
# bit for bit: 272 rows 23.7 vs 18.5, 1040 rows 74.8 vs 70.7, 2048 rows 154 vs 133. It is a second
# copy of every Linear weight (decode's own kernels read the plain one there; where bf16 is widened
# instead, pack_widened makes decode's copies by this same rule), so it is made only where
# the copies take at most PACK_MAX_SHARE of the memory available once the caches are allocated: a
# model too large for that keeps the per-call reorder.
PACK_MAX_SHARE = 0.25
PACKED_ATTR = "_bb_onednn_packed"


def pack_native(weights: list[torch.Tensor], available_bytes: int | None, mod=None) -> int:
    """Give each bf16 weight [N, K] a oneDNN-layout copy (an attribute of the tensor, read by
    _native) where the native path runs and the copies fit PACK_MAX_SHARE of available_bytes.
    Returns the bytes packed (0: none, all or nothing)."""
    mod = mod or module()
    if mod is None or POLICY[mod.isa()][2] != "native":
        return 0
    return _pack_all(weights, available_bytes, _pack)


def fits(nbytes: int, available_bytes: int | None) -> bool:
    """Whether a copy of nbytes fits PACK_MAX_SHARE of available_bytes (None: unknown, no)."""
    return available_bytes is not None and nbytes <= PACK_MAX_SHARE * available_bytes


def _pack_all(weights: list[torch.Tensor], available_bytes: int | None, pack) -> int:
    """pack(w) for every distinct bf16 weight [N, K] where their bytes fit PACK_MAX_SHARE of
    available_bytes (else none); returns those bytes."""
    todo = {id(w): w for w in weights if w.dtype == torch.bfloat16 and w.dim() == 2}
    total = sum(w.numel() * w.element_size() for w in todo.values())
    if not todo or not fits(total, available_bytes):
        return 0
    for w in todo.values():
        pack(w)
    return total


def _pack(w: torch.Tensor) -> torch.Tensor:
    """w bf16 [N, K], with its oneDNN-layout copy attached (the row count is only a layout hint:
    the copy serves every row count alike)."""
    setattr(w, PACKED_ATTR, torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), NATIVE_ROW_BLOCK))
    return w


def native_row_counts(max_rows: int, mod=None) -> list[int]:
    """The padded row counts the native path can give oneDNN for up to max_rows rows (empty where
    this CPU has no native path)."""
    mod = mod or module()
    if mod is None or POLICY[mod.isa()][2] != "native":
        return []
    B = native_row_block(mod)
    first = (_rows_max(mod, False, True) // B + 1) * B     # the smallest padded M above the rows path
    return list(range(first, -(-max_rows // B) * B + 1, B))


def warm_native(shapes: set[tuple[int, int]], max_rows: int, budget_s: float = 5.0, mod=None,
                packed: bool = False) -> int:
    """Have oneDNN compile its kernel for each bf16 weight shape (N, K) at each padded row count
    (on packed weights where the model's are: another kernel), fewest rows first, until budget_s
    has passed (a large model's matmuls are too slow to try them all; there the compile time is
    small beside a prefill). Returns the kernels warmed."""
    t0, n = time.monotonic(), 0
    weights = {s: torch.zeros(s, dtype=torch.bfloat16) for s in sorted(shapes)}
    if packed:
        weights = {s: _pack(w) for s, w in weights.items()}
    for M in native_row_counts(max_rows, mod):
        for (_, K), w in weights.items():
            if time.monotonic() - t0 > budget_s:
                return n
            _native(torch.zeros(M, K, dtype=torch.bfloat16), w, None, M)
            n += 1
    return n


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype | None = None, *, mod=None) -> torch.Tensor:
    """See ops.quant.int8_linear_ref: x [M, K] @ (int8 q [N, K] * scale [N])^T -> [M, N] in
    out_dtype (default x's dtype)."""
    mod = mod or module()
    out_dtype = out_dtype or x.dtype
    y = mod.linear_int8(x, q, scale, None, out_dtype == torch.float32, _panel(mod, x.shape[0], True))
    return y if y.dtype == out_dtype else y.to(out_dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int, *,
                mod=None) -> torch.Tensor:
    """See ops.quant.int4_linear_ref: x [M, K] @ dequant(uint8 [N, K // 2], [N, K // G])^T."""
    mod = mod or module()
    return mod.linear_int4(x, packed, scales, group_size, x.dtype == torch.float32,
                           _panel(mod, x.shape[0], True))


def supports(x: torch.Tensor, *weights: torch.Tensor, group_size: int | None = None, mod=None) -> bool:
    """Whether these CPU tensors take the C++ path (else the caller runs the torch reference):
    fp32/bf16 activations; int4 groups a whole number of vector steps (else every element would
    take the kernels' scalar tail)."""
    if x.dtype not in X_DTYPES or not x.is_cpu or not all(w.is_cpu for w in weights):
        return False
    return group_size is None or group_size % (mod or module()).INT4_STEP == 0
