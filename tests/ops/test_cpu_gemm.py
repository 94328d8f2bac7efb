"""The C++ CPU GEMMs (ops/cpu/gemm.cpp) against the torch references, on every ISA level the tests
build: this CPU's best, AVX2 and the portable one. Odd shapes on purpose: M = 1, 3, 17, 64, 100
(full and partial register tiles, both paths), N not a multiple of the channel block, K not a
multiple of the vector width (the scalar tail)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from backboard.ops import dispatch, quant
from backboard.ops.cpu import build, decode_ops, gemm
from backboard.ops.cpu.build import cpu_family, supported_isas

LEVELS = list(dict.fromkeys(lv for lv in (build.cpu_isa(), "avx2", "portable")
                            if lv in build.supported_isas()))
ROWS = (1, 3, 17, 64, 100)


@pytest.fixture(scope="session")
def gemm_mods():
    """Every tested level, built once per session (in parallel: each build takes ~30 s)."""
    with ThreadPoolExecutor(len(LEVELS)) as ex:
        mods = dict(zip(LEVELS, ex.map(gemm.module, LEVELS)))
    assert all(mods.values()), f"a kernel build failed: {mods} (is g++ installed?)"
    return mods


@pytest.fixture(params=LEVELS)
def mod(request, gemm_mods):
    m = gemm_mods[request.param]
    assert m.isa() == request.param
    return m


def _ref_bf16(x, w, bias=None):
    y = x.float() @ w.float().t()
    return y if bias is None else y + bias.float()


def _close_fp32(y, ref):
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x_fp32", "x_bf16"])
@pytest.mark.parametrize("panel", [False, True], ids=["rows", "panel"])
def test_bf16_weights_match_fp32_reference(mod, M, x_dtype, panel):
    N, K = 67, 100 + mod.VW + 3                          # partial channel block, K tail
    w, x, b = torch.randn(N, K).bfloat16(), torch.randn(M, K).to(x_dtype), torch.randn(N)
    ref = _ref_bf16(x, w)
    _close_fp32(mod.linear_bf16(x, w, None, True, panel), ref)
    _close_fp32(mod.linear_bf16(x, w, b, True, panel), ref + b)
    y16 = mod.linear_bf16(x, w, b.bfloat16(), False, panel)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16, (ref + b.bfloat16().float()).bfloat16(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x_fp32", "x_bf16"])
def test_one_row_gemv_over_long_rows(mod, x_dtype):
    """M = 1 reads each channel start to end with four accumulators along K (gemv): rows long
    enough for several unrolled steps plus a vector and a scalar tail, a partial block of 8
    channels, for bf16 and int8 weights."""
    N, K = 67, 8 * 4 * mod.VW + 2 * mod.VW + 3
    x = torch.randn(1, K).to(x_dtype)
    w, b = torch.randn(N, K).bfloat16(), torch.randn(N)
    _close_fp32(mod.linear_bf16(x, w, b, True, False), _ref_bf16(x, w) + b)
    q, s = quant.quantize_int8(torch.randn(N, K))
    _close_fp32(mod.linear_int8(x, q, s, None, True, False), quant.int8_linear_ref(x.float(), q, s))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x_fp32", "x_bf16"])
def test_two_rows_over_a_large_weight_read_in_address_order(mod, x_dtype):
    """M = 2 over a weight of 8M+ elements in short rows takes gemv_rows (the GEMV's order, each
    weight vector for both rows) where it pays (bf16 x on bf16 weights with VDPBF16PS, int8 weights
    on AVX2), the tiles elsewhere: a strided x, a partial block of 8 channels, a K tail."""
    N, K = (8 << 20) // 600 + 5, 600
    xs = torch.randn(2, K + 7).to(x_dtype)[:, :K]
    w, b = torch.randn(N, K).bfloat16(), torch.randn(N)
    _close_fp32(mod.linear_bf16(xs, w, b, True, False), _ref_bf16(xs, w) + b)
    q, s = quant.quantize_int8(torch.randn(N, K))
    _close_fp32(mod.linear_int8(xs, q, s, None, True, False), quant.int8_linear_ref(xs.float(), q, s))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x_fp32", "x_bf16"])
def test_two_to_four_rows_in_address_order_over_any_weight_where_set(mod, x_dtype):
    """With gemv_rows set wide (gemm.GEMV_ROWS_WIDE, taken on Zen 5; set here on every level, and
    for bf16 weights widened in registers, which AVX2 Zen 3s take at 2-4 rows over LM heads),
    2, 3 and 4 rows over layer-sized weights up to K = 2048 go through gemv_rows (its 3- and 4-row
    forms), exact against the reference: a strided x, a partial block of 8 channels, a K tail;
    the settings refuse more than 4 rows."""
    kept, kept_widened = mod.gemv_rows(), mod.gemv_rows_widened()
    zen3_avx2 = mod.isa() == supported_isas()[0] == "avx2" and cpu_family() == gemm.ZEN3
    default = gemm.GEMV_ROWS_WIDE if gemm.zen5(mod) else gemm.GEMV_ROWS_ZEN3 if zen3_avx2 else (2, 8 << 20, 1024)
    assert kept == default
    assert kept_widened == (gemm.WIDENED_GEMV_ROWS if zen3_avx2 else 0)
    try:
        mod.set_gemv_rows(*gemm.GEMV_ROWS_WIDE)
        mod.set_gemv_rows_widened(4)        # bf16 weights widened in registers (Bf16W) too
        assert mod.gemv_rows() == gemm.GEMV_ROWS_WIDE and mod.gemv_rows_widened() == 4
        for M, N, K in ((2, 61, 600), (3, 1537, 576), (4, 203, 2047), (4, 77, 2048)):
            xs = torch.randn(M, K + 7).to(x_dtype)[:, :K]
            w, b = torch.randn(N, K).bfloat16(), torch.randn(N)
            _close_fp32(mod.linear_bf16(xs, w, b, True, False), _ref_bf16(xs, w) + b)
            q, s = quant.quantize_int8(torch.randn(N, K))
            _close_fp32(mod.linear_int8(xs, q, s, None, True, False), quant.int8_linear_ref(xs.float(), q, s))
        with pytest.raises(ValueError, match="max_m"):
            mod.set_gemv_rows(5, 0, 2048)
        for bad in (1, 5):
            with pytest.raises(ValueError, match="max_m"):
                mod.set_gemv_rows_widened(bad)
    finally:
        mod.set_gemv_rows(*kept)
        mod.set_gemv_rows_widened(kept_widened)


def test_five_to_48_rows_in_groups_of_four_where_four_rows_stream(mod):
    """Bf16 weights widened in registers where gemv_rows takes 4 rows (AVX2 Zen 3s: the LM head)
    take 5 to 48 rows in groups of 4 (gemm_gemv.h), the last 1-3 rows a group of their own, the
    groups after a block's first 2 channels at a time (gemv_rows_pair; 13 and 48 rows): exact
    against the reference at every remainder, with a partial block of 8 channels, a K tail, a
    strided x, a bias and bf16 outputs the fp32 ones rounded."""
    kept, kept_widened = mod.gemv_rows(), mod.gemv_rows_widened()
    try:
        mod.set_gemv_rows(*gemm.GEMV_ROWS_WIDE)
        mod.set_gemv_rows_widened(4)
        for M, N, K in ((5, 61, 600), (6, 203, 2047), (7, 77, 512), (13, 99, 528), (48, 37, 256)):
            xs = torch.randn(M, K + 7)[:, :K]
            w, b = torch.randn(N, K).bfloat16(), torch.randn(N)
            y32 = mod.linear_bf16(xs, w, b, True, False)
            _close_fp32(y32, _ref_bf16(xs, w) + b)
            assert torch.equal(mod.linear_bf16(xs, w, b, False, False), y32.bfloat16()), f"M={M}"
    finally:
        mod.set_gemv_rows(*kept)
        mod.set_gemv_rows_widened(kept_widened)


@pytest.mark.parametrize("wide", [False, True], ids=["default", "gemv_rows_wide"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x_fp32", "x_bf16"])
def test_bf16_outputs_are_the_fp32_sums_rounded_to_nearest_even(mod, x_dtype, wide):
    """The decode paths store whole blocks of channels 4 at a time (store_sums4): a bf16 output is
    exactly the same path's fp32 output rounded as torch rounds it (nearest even; truncating
    differs in about half the entries), the bias added before rounding, a NaN kept a NaN; 1 to 8
    rows (the GEMVs and the tiles), whole blocks and a partial one, with gemv_rows as Zen 5 sets
    it and as elsewhere."""
    kept = mod.gemv_rows()
    try:
        if wide:
            mod.set_gemv_rows(*gemm.GEMV_ROWS_WIDE)
        N, K = 8 * 5 + 3, 512
        w, b = torch.randn(N, K).bfloat16(), torch.randn(N)
        for M in range(1, 9):
            x = torch.randn(M, K).to(x_dtype)
            y32, y16 = mod.linear_bf16(x, w, b, True, False), mod.linear_bf16(x, w, b, False, False)
            assert torch.equal(y16, y32.bfloat16()), f"M={M}"
            x[M - 1, 5] = float("nan")
            y16 = mod.linear_bf16(x, w, None, False, False)
            assert y16[M - 1].float().isnan().all() and not y16[: M - 1].float().isnan().any()
    finally:
        mod.set_gemv_rows(*kept)


@pytest.mark.parametrize("M", (2, 3))
def test_two_or_three_bf16_rows_over_an_lm_head_widened_to_fp32(mod, M):
    """bf16 x of 2-3 rows over a large weight in short rows runs on the fp32 tiles on AVX512-BF16
    (gemm.FP32_X_ROWS, measured faster there) but for Zen 5 (gemm.GEMV_ROWS_WIDE: gemv_rows is
    faster there); the output keeps x's dtype and the exact products."""
    N, K = (8 << 20) // 600 + 5, 600
    x, w, b = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16(), torch.randn(N)
    widened = gemm._isa_running(mod) == "avx512_bf16" and not gemm.zen5(mod)
    assert gemm._widen_x_pays(mod, x, w) == widened
    assert not gemm._widen_x_pays(mod, x[:, :512], w[:64, :512])
    y = gemm.linear_bf16(x, w, b, torch.float32, mod=mod)
    assert y.dtype == torch.float32
    _close_fp32(y, _ref_bf16(x, w) + b)
    assert gemm.linear_bf16(x, w, mod=mod).dtype == torch.bfloat16


def test_fourteen_or_fifteen_rows_over_many_channels(mod):
    """bf16 x of 14-15 rows over 2048+ channels takes the lanes path padded to 16 rows on
    AVX512-BF16 (lanes_pays): the padding rows never reach the output; 12-13 rows take the tiles."""
    N, K = 2048 + 5, 2 * 64 + 2
    w, b = torch.randn(N, K).bfloat16(), torch.randn(N)
    for M in (12, 13, 14, 15):
        x = torch.randn(M, K).bfloat16()
        y = mod.linear_bf16(x, w, b, True, False)
        assert y.shape == (M, N)
        _close_fp32(y, _ref_bf16(x, w) + b)


def test_lanes_tiles_of_twelve_channels_where_set(mod):
    """With 12 channels per lanes tile at one row vector (gemm.LANES_CHANNELS_WIDE, taken on Zen 5;
    set here on every level that has the lanes kernel), 12-16 rows are exact against the
    reference: channel tails of every size past and below the 8 of one store (N = 12 t + r),
    strided rows, bias, fp32 and bf16 outputs; 17 rows (two vectors) keep the 6-channel tiles. The
    setting takes 6 or 12 only."""
    kept = mod.lanes_channels()
    if kept == 0:                                       # no lanes kernel at this level: no setting
        assert mod.isa() not in ("avx512_bf16", "amx_bf16")
        mod.set_lanes_channels(12)
        assert mod.lanes_channels() == 0
        return
    assert kept == (gemm.LANES_CHANNELS_WIDE if gemm.zen5(mod) else 6)
    try:
        mod.set_lanes_channels(12)
        K = 2 * 64 + 2 * mod.VW + 2
        for M in (12, 16, 17):
            for N in (1, 7, 9, 12, 23, 2048 + 13):
                w, b = torch.randn(N, K).bfloat16(), torch.randn(N)
                x = torch.randn(M, 2 * K).bfloat16()[:, :K]
                ref = _ref_bf16(x, w) + b
                _close_fp32(mod.linear_bf16(x, w, b, True, False), ref)
                torch.testing.assert_close(mod.linear_bf16(x, w, b, False, False), ref.bfloat16(), rtol=1e-2, atol=1e-2)
        with pytest.raises(ValueError, match="6 or 12"):
            mod.set_lanes_channels(8)
    finally:
        mod.set_lanes_channels(kept)


@pytest.mark.parametrize("M", (16, 17, 33, 64, 80))
def test_bf16_rows_in_lanes_match_the_reference(mod, M):
    """bf16 x of 16+ rows and even K take the lanes path on AVX512-BF16 (gemm_lanes.h: rows in the
    vector lanes, a weight pair broadcast): partial row vectors (17, 33, 80), channel tails of
    every size 1-5 (N = 6 t + r), strided rows, bias, fp32 and bf16 outputs; use_lanes=False (the
    rows path) gives the same sums. Other levels ignore the flag and must agree as well."""
    K = 2 * 64 + 2 * mod.VW + 2                         # even, not a whole number of vectors
    for N in (1, 5, 67, 96):
        w = torch.randn(N, K).bfloat16()
        x = torch.randn(M, 2 * K).bfloat16()[:, :K]         # strided rows
        b = torch.randn(N)
        ref = _ref_bf16(x, w) + b
        for lanes in (True, False):
            _close_fp32(mod.linear_bf16(x, w, b, True, False, lanes), ref)
            y16 = mod.linear_bf16(x, w, b, False, False, lanes)
            assert y16.dtype == torch.bfloat16
            torch.testing.assert_close(y16, ref.bfloat16(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("M", (4, 5, 16, 17, 33, 64, 150))
def test_bf16_rows_on_amx_tiles_match_the_reference(mod, M):
    """bf16 x of 4+ rows with K a multiple of 32 takes AMX tiles on amx_bf16 (gemm_amx.h: the
    weight's channels as tile rows, C^T transposed on the way out): whole 32-channel tasks with
    the N % 32 tail on the VDPBF16PS paths (N = 32, 67, 101), partial and paired 16-row blocks,
    150 rows (x packed in two 128-row chunks, the second partial), strided rows, a K of several
    tiles, bias, fp32 and bf16 outputs; use_amx=False gives the same
    sums, and so must every other level (which ignores the flag)."""
    for N, K in ((32, 32), (67, 96), (101, 2048)):
        w = torch.randn(N, K).bfloat16()
        x = torch.randn(M, K + 32).bfloat16()[:, :K]         # strided rows
        b = torch.randn(N)
        ref = _ref_bf16(x, w) + b
        for amx in (True, False):
            _close_fp32(mod.linear_bf16(x, w, b, True, False, True, amx), ref)
            y16 = mod.linear_bf16(x, w, b, False, False, True, amx)
            torch.testing.assert_close(y16, ref.bfloat16(), rtol=1e-2, atol=1e-2)


def test_amx_tiles_run_where_the_cpu_has_them(mod):
    """The amx_bf16 build asks Linux for the tile state once (arch_prctl) and uses AMX wherever
    the CPU has AMX-BF16; every other build reports no AMX. A K that is not a multiple of 32
    (no whole tile) still gives the right sums on the other paths."""
    flags = build.cpu_flags()
    assert mod.amx() == (mod.isa() == "amx_bf16" and {"amx_tile", "amx_bf16"} <= flags)
    w, x = torch.randn(64, 100).bfloat16(), torch.randn(8, 100).bfloat16()
    _close_fp32(mod.linear_bf16(x, w, None, True, False), _ref_bf16(x, w))


def test_bf16_strided_rows_and_batched_shapes(mod):
    w = torch.randn(40, 72).bfloat16()
    x = torch.randn(6, 2 * 72)[:, :72]                   # rows strided, elements contiguous
    _close_fp32(mod.linear_bf16(x, w, None, True, False), _ref_bf16(x, w))
    x3 = torch.randn(2, 5, 72).bfloat16()
    y = gemm.linear_bf16(x3, w, mod=mod)
    assert y.shape == (2, 5, 40) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), _ref_bf16(x3.reshape(10, 72), w).view(2, 5, 40),
                               rtol=1e-2, atol=1e-2)


def test_large_outputs_reuse_freed_blocks_without_page_faults(mod):
    """Outputs of 8 MiB and more (the logits) come from big_alloc.h's cache: a live output is never
    handed out again, a freed one is reused with its pages still mapped (glibc would map and
    zero 9,400 fresh pages for each 38 MB output: over its 32 MiB mmap threshold)."""
    import resource

    w, x = torch.randn(150_000, 32).bfloat16(), torch.randn(64, 32).bfloat16()
    ref = _ref_bf16(x, w)
    y1 = mod.linear_bf16(x, w, None, True, False)
    y2 = mod.linear_bf16(x * 2, w, None, True, False)
    assert y1.data_ptr() != y2.data_ptr()
    _close_fp32(y1, ref)                                  # not overwritten by the second call
    ptr = y1.data_ptr()
    del y1
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y3 = mod.linear_bf16(x, w, None, True, False)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert y3.data_ptr() == ptr and faults < 64, faults
    _close_fp32(y3, ref)
    _close_fp32(y2, 2 * ref)


@pytest.mark.parametrize("M", (200, 256, 1000))
def test_onednn_sees_only_padded_row_counts(mod, M, monkeypatch):
    """Large bf16 x on a native level reaches oneDNN padded to whole row blocks (a new row count
    would make it compile a kernel), with the same product as unpadded; warm_native compiles
    exactly the row counts the native path can send, within its budget."""
    if gemm.POLICY[mod.isa()][2] != "native":
        assert gemm.native_row_counts(2048, mod) == []
        return
    seen, linear = [], F.linear
    monkeypatch.setattr(gemm.F, "linear", lambda x, w, b=None: seen.append(x.shape[0]) or linear(x, w, b))
    w, b = torch.randn(96, 80).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(M, 80).bfloat16()
    y = gemm.linear_bf16(x, w, b, mod=mod)
    assert y.shape == (M, 96) and y.is_contiguous()
    torch.testing.assert_close(y, linear(x, w, b), rtol=1e-2, atol=1e-2)
    B = gemm.native_row_block(mod)
    assert B == (64 if mod.amx() else 16)
    assert seen == [-(-M // B) * B]
    counts = gemm.native_row_counts(1000, mod)
    assert counts[0] > (gemm.AMX_ROWS_MAX if mod.amx() else gemm.POLICY[mod.isa()][0])
    assert counts == list(range(counts[0], -(-1000 // B) * B + 1, B))        # 1008 (16) or 1024 (64)
    seen.clear()
    assert gemm.warm_native({(96, 80), (32, 80)}, 1000, mod=mod) == 2 * len(counts)
    assert sorted(set(seen)) == counts
    assert gemm.warm_native({(96, 80)}, 1000, budget_s=-1, mod=mod) == 0


@pytest.mark.parametrize("M", (200, 1000))
def test_packed_weights_give_the_same_product(mod, M, monkeypatch):
    """pack_native keeps a oneDNN-layout copy of each bf16 weight (all or none: within
    PACK_MAX_SHARE of the memory available); the native path then multiplies by it, padded as
    before, bit for bit the product of the plain weight; warm_native compiles the packed kernels."""
    if gemm.POLICY[mod.isa()][2] != "native":
        assert gemm.pack_native([torch.randn(96, 80).bfloat16()], 1 << 40, mod=mod) == 0
        return
    w, b, w2 = torch.randn(96, 80).bfloat16(), torch.randn(96).bfloat16(), torch.randn(32, 80).bfloat16()
    x = torch.randn(M, 80).bfloat16()
    plain = gemm.linear_bf16(x, w, b, mod=mod)
    need = (96 + 32) * 80 * 2
    assert gemm.pack_native([w, w2, w], int(need / gemm.PACK_MAX_SHARE) - 1, mod=mod) == 0   # no room
    assert getattr(w, gemm.PACKED_ATTR, None) is None
    assert gemm.pack_native([w, w2, w], int(need / gemm.PACK_MAX_SHARE), mod=mod) == need
    assert getattr(w, gemm.PACKED_ATTR).is_mkldnn and getattr(w2, gemm.PACKED_ATTR).is_mkldnn
    seen, pointwise = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(gemm.torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: seen.append(x.shape[0]) or pointwise(x, *a), raising=False)
    monkeypatch.setattr(gemm.F, "linear", lambda *a: pytest.fail("the plain weight was used"))
    packed = gemm.linear_bf16(x, w, b, mod=mod)
    assert torch.equal(packed, plain) and seen == [-(-M // gemm.native_row_block(mod)) * gemm.native_row_block(mod)]
    seen.clear()
    counts = gemm.native_row_counts(1000, mod)
    assert gemm.warm_native({(96, 80)}, 1000, mod=mod, packed=True) == len(counts) and seen == counts


def test_fp32_activations_are_not_rounded_to_bf16(mod):
    """Weights in bf16, activations in fp32: products use the full fp32 x (a kernel that rounded x
    to bf16, as VDPBF16PS would, loses the 2^-12 terms)."""
    K = 256
    w = torch.ones(8, K, dtype=torch.bfloat16)
    x = torch.full((2, K), 1.0 + 2.0 ** -12)
    y = mod.linear_bf16(x, w, None, True, False)
    assert torch.all(y == K * (1.0 + 2.0 ** -12)), y[0, 0].item()


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x_fp32", "x_bf16"])
def test_int8_matches_reference(mod, M, x_dtype):
    N, K = 45, 2 * mod.VW + 5
    q, s = quant.quantize_int8(torch.randn(N, K))
    x = torch.randn(M, K).to(x_dtype)
    ref = quant.int8_linear_ref(x.float(), q, s)
    for panel in (False, True):
        _close_fp32(mod.linear_int8(x, q, s, None, True, panel), ref)
    y = gemm.int8_linear(x, q, s, mod=mod)
    assert y.dtype == x_dtype
    torch.testing.assert_close(y.float(), quant.int8_linear_ref(x, q, s).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("group", [32, 48, 128])
def test_int4_matches_reference(mod, M, group):
    """group 48 is not a whole number of AVX-512 steps: the kernel takes its scalar path there."""
    N, K = 37, 384
    p, sc = quant.quantize_int4(torch.randn(N, K), group, scale_dtype=torch.bfloat16)
    x = torch.randn(M, K)
    ref = quant.int4_linear_ref(x, p, sc, group)
    for panel in (False, True):
        _close_fp32(mod.linear_int4(x, p, sc, group, True, panel), ref)
    xb = x.bfloat16()
    torch.testing.assert_close(gemm.int4_linear(xb, p, sc, group, mod=mod).float(),
                               quant.int4_linear_ref(xb, p, sc, group).float(), rtol=1e-2, atol=1e-2)


def test_a_wrong_weight_fails_the_comparison(mod):
    """The tolerances catch a one-element error in the weights (these tests can fail)."""
    w, x = torch.randn(16, 64).bfloat16(), torch.randn(3, 64)
    bad = w.clone()
    bad[5, 63] += 1.0
    with pytest.raises(AssertionError):
        _close_fp32(mod.linear_bf16(x, bad, None, True, False), _ref_bf16(x, w))


def test_bad_arguments_are_clear_errors(mod):
    w = torch.randn(8, 32).bfloat16()
    with pytest.raises(RuntimeError, match="K=31 but the weight has K=32"):
        mod.linear_bf16(torch.randn(2, 31), w, None, True, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        mod.linear_bf16(torch.randn(2, 32).half(), w, None, True, False)
    with pytest.raises(RuntimeError, match="bias must be"):
        mod.linear_bf16(torch.randn(2, 32), w, torch.zeros(7), True, False)
    with pytest.raises(RuntimeError, match="group_size must be even"):
        mod.linear_int4(torch.randn(2, 32), torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1), 12)
    assert mod.linear_bf16(torch.randn(0, 32), w, None, True, False).shape == (0, 8)


# ---- dispatch: which implementation runs -----------------------------------------------------
@pytest.fixture
def spy(monkeypatch, gemm_mods):
    calls = []
    for name in ("linear_bf16", "int8_linear", "int4_linear"):
        real = getattr(gemm, name)
        monkeypatch.setattr(gemm, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    monkeypatch.delenv("BACKBOARD_CPU_KERNELS", raising=False)
    return calls


def test_dispatch_runs_the_cpu_kernels_in_auto_mode(spy):
    w, x = torch.randn(24, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    q, s = quant.quantize_int8(w.float())
    p, sc = quant.quantize_int4(w.float(), 32)
    y = dispatch.linear(x, w, out_dtype=torch.float32)
    _close_fp32(y, _ref_bf16(x, w))
    dispatch.int8_linear(x.float(), q, s)
    dispatch.int4_linear(x, p, sc, 32)
    assert spy == ["linear_bf16", "int8_linear", "int4_linear"]
    with dispatch.override("torch"):                      # the oracle stays reachable
        torch.testing.assert_close(dispatch.linear(x, w), F.linear(x, w))
        dispatch.int8_linear(x.float(), q, s)
    assert len(spy) == 3
    dispatch.linear(x.float(), w.float())                 # fp32 weights: torch's fp32 GEMM
    dispatch.int4_linear(x, *quant.quantize_int4(w.float(), 16), 16)   # 16 % INT4_STEP: reference
    assert len(spy) == 3 + (16 % gemm.module().INT4_STEP == 0)


def test_engines_build_the_kernels_before_their_first_request(monkeypatch):
    """The runner calls prepare_cpu_kernels at start-up: both families are built (or loaded) for a
    CPU float32 / bfloat16 model, nothing for other devices, dtypes, or with the kernels off."""
    built = []
    monkeypatch.setattr(gemm, "module", lambda isa=None: built.append("gemm"))
    monkeypatch.setattr(decode_ops, "kernels", lambda isa=None: built.append("decode_ops"))
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    monkeypatch.delenv("BACKBOARD_CPU_KERNELS", raising=False)
    cpu = torch.device("cpu")
    dispatch.prepare_cpu_kernels(cpu, torch.bfloat16)
    assert built == ["gemm", "decode_ops"]
    dispatch.prepare_cpu_kernels(torch.device("cuda"), torch.bfloat16)
    dispatch.prepare_cpu_kernels(cpu, torch.float16)
    with dispatch.override("torch"):
        dispatch.prepare_cpu_kernels(cpu, torch.bfloat16)
    monkeypatch.setenv("BACKBOARD_CPU_KERNELS", "0")
    dispatch.prepare_cpu_kernels(cpu, torch.float32)
    assert built == ["gemm", "decode_ops"]


def test_the_runner_has_onednn_compile_the_models_shapes(monkeypatch):
    """warm_cpu_gemm packs the model's bf16 Linear weights (where the copies fit the memory
    available) and passes their shapes to warm_native where the native path runs, and nothing for
    other devices, with the kernels off, or without bf16 weights."""
    from torch import nn

    from backboard.layers.linear import Linear, bf16_linear_weights
    model = nn.Sequential(Linear(64, [32, 32], torch.bfloat16), Linear(64, 48, torch.bfloat16),
                          Linear(64, 48, torch.bfloat16), Linear(16, 8, torch.float32), nn.Linear(4, 4))
    weights = bf16_linear_weights(model)
    shapes = {(64, 64), (48, 64)}
    assert {tuple(w.shape) for w in weights} == shapes and len(weights) == 3
    calls, packs = [], []
    monkeypatch.setattr(gemm, "warm_native", lambda s, m, mod=None, packed=False: calls.append((s, m, packed)) or 0)
    monkeypatch.setattr(gemm, "pack_native", lambda ws, avail, mod=None: packs.append(len(ws)) or 7)
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    monkeypatch.delenv("BACKBOARD_CPU_KERNELS", raising=False)
    cpu = torch.device("cpu")
    dispatch.warm_cpu_gemm(cpu, weights, 512)
    dispatch.warm_cpu_gemm(torch.device("cuda"), weights, 512)
    dispatch.warm_cpu_gemm(cpu, [], 512)
    with dispatch.override("torch"):
        dispatch.warm_cpu_gemm(cpu, weights, 512)
    native = bool(gemm.native_row_counts(512))
    assert calls == ([(shapes, 512, True)] if native else [])
    assert packs == ([3] if native else [])
    assert dispatch.available_memory() > 0


def test_disabled_kernels_fall_back_to_the_references(spy, monkeypatch):
    monkeypatch.setenv("BACKBOARD_CPU_KERNELS", "0")
    w, x = torch.randn(24, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(dispatch.linear(x, w), F.linear(x, w))
    assert spy == []


def test_a_failed_build_warns_once_and_returns_none(monkeypatch, caplog):
    """No compiler: every family returns None (the references run) and the process is told once,
    not once per family or level."""
    def no_compiler(*a):
        raise RuntimeError("Error building extension\ng++: not found")
    monkeypatch.setattr(build, "_build", no_compiler)
    monkeypatch.setattr(build, "_build_failed", False)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load_kernels("gemm_test_nocc", ("gemm.cpp",), "portable") is None
        assert build.load_kernels("gemm_test_nocc2", ("gemm.cpp",), "portable") is None
    msgs = [r.message for r in caplog.records if "could not build" in r.message]
    assert len(msgs) == 1 and "g++: not found" in msgs[0] and "torch references" in msgs[0]


def test_an_engine_without_a_compiler_serves_on_the_references_and_says_so_once(hybrid_model, tmp_path):
    """A fresh process whose compiler is missing (CXX points nowhere, an empty extension cache):
    a bf16 engine builds nothing, generates the same greedy tokens as BACKBOARD_KERNELS=torch, and
    logs the failed build once."""
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING);"
            "from backboard.engine.llm import LLM; from backboard.sampling_params import SamplingParams;"
            f"llm = LLM({hybrid_model!r}, dtype='bfloat16', max_model_len=128, max_num_seqs=2);"
            "out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0));"
            "print('tokens', out[0].outputs[0].token_ids)")
    runs = {}
    for name, extra in (("nocc", {"CXX": str(tmp_path / "no-such-g++")}), ("torch", {"BACKBOARD_KERNELS": "torch"})):
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), **extra)
        env.pop("BACKBOARD_CPU_KERNELS", None)
        env.setdefault("BACKBOARD_KERNELS", "auto")
        runs[name] = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                    timeout=600)
        assert runs[name].returncode == 0, runs[name].stderr
    assert runs["nocc"].stderr.count("could not build") == 1, runs["nocc"].stderr
    assert "torch references" in runs["nocc"].stderr
    assert "could not build" not in runs["torch"].stderr
    tokens = [ln for ln in runs["nocc"].stdout.splitlines() if ln.startswith("tokens")]
    assert tokens and tokens == [ln for ln in runs["torch"].stdout.splitlines() if ln.startswith("tokens")]


def test_engine_without_kernels_runs_on_the_references(tmp_path):
    """BACKBOARD_CPU_KERNELS=0 in a fresh process: the layers still run (torch references) and the
    log says so once."""
    code = ("import logging, torch; logging.basicConfig(level=logging.WARNING);"
            "from backboard.layers.linear import Linear; from backboard.layers.embedding import ParallelLMHead;"
            "lin = Linear(64, [32, 16], torch.bfloat16); torch.nn.init.normal_(lin.weight);"
            "head = ParallelLMHead(100, 64, torch.bfloat16); torch.nn.init.normal_(head.weight);"
            "x = torch.randn(3, 64).bfloat16();"
            "assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight));"
            "assert head(x).dtype == torch.float32; lin(x); print('ok')")
    env = dict(os.environ, BACKBOARD_CPU_KERNELS="0")
    env.pop("BACKBOARD_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert r.stderr.count("CPU kernels disabled") == 1, r.stderr


# ---- the whole model in bf16 -----------------------------------------------------------------
def _two_steps(path: str, dtype: str, mode: str) -> torch.Tensor:
    """Prefill of 100 + 7 tokens (the panel path), then a 2-row decode step (the rows path):
    the decode logits [2, V] in fp32."""
    from tests.models.driver import FlatBatchDriver

    d = FlatBatchDriver(path, dtype=dtype, block_size=8, num_blocks=64, num_slots=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (100, 7)]
    with dispatch.override(mode):
        d.step([(0, prompts[0]), (1, prompts[1])])
        out = d.step([(0, [5]), (1, [9])])
    return torch.stack([out[0], out[1]]).float()


def test_bf16_model_on_the_kernels_is_as_close_to_fp32_as_torch_bf16(hybrid_model, spy):
    """The same checkpoint in bf16 through our kernels and through torch's bf16 matmuls, both
    against the fp32 model: ours is no further from it (fp32 accumulation, one rounding)."""
    fp32 = _two_steps(hybrid_model, "float32", "torch")
    torch_bf16 = _two_steps(hybrid_model, "bfloat16", "torch")
    assert spy == []
    ours = _two_steps(hybrid_model, "bfloat16", "auto")
    assert spy.count("linear_bf16") >= 2 * 4, spy          # every layer's projections, both steps
    err_ours, err_torch = (ours - fp32).abs().max(), (torch_bf16 - fp32).abs().max()
    scale = fp32.abs().max()
    assert err_ours <= 1.25 * err_torch + 1e-3 * scale, (err_ours, err_torch, scale)
    assert err_ours <= 0.1 * scale
