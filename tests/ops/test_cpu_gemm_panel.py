"""The CPU GEMMs' panel path (gemm.cpp): weights widened to fp32 panels for torch's fp32 GEMM."""

from __future__ import annotations

import itertools

import pytest
import torch

from backboard.ops.cpu import gemm
from tests.ops.cpu_isas import isa_param


@pytest.mark.parametrize("threads", [2, 3])
@isa_param
def test_panel_path_in_each_threads_own_panels_to_128_rows_then_shared(isa, threads):
    """The panel path up to 128 rows splits the channels into as many blocks per thread, each
    widened into that thread's own panel (gemm.cpp's panel_own), from 129 rows into one shared panel:
    every output channel written once and right at both sides of 128, with fewer channels than
    threads, blocks that do not divide N, and K long enough that a block is the 16-channel minimum;
    under inference mode too, as the engine runs (its worker threads do not inherit the mode)."""
    mod, kept = gemm.module(isa), torch.get_num_threads()
    assert mod is not None, f"the gemm CPU kernels did not build for {isa}"
    torch.set_num_threads(threads)
    try:
        for (M, N, K), inference in itertools.product(
                ((49, 1, 100), (128, 2, 33), (128, 1547, 111), (129, 1547, 111), (64, 67, 8200), (200, 5, 64)),
                (False, True)):
            x, w, b = torch.randn(M, K), torch.randn(N, K).bfloat16(), torch.randn(N)
            with torch.inference_mode(inference):
                y = mod.linear_bf16(x, w, b, True, True)     # fp32 sums of up to 8200 terms: rtol 1e-4
            torch.testing.assert_close(y, x @ w.float().t() + b, rtol=1e-4, atol=1e-3, msg=f"M={M} N={N} K={K}")
    finally:
        torch.set_num_threads(kept)
