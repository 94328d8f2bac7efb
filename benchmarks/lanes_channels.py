"""The lanes kernel's channels per tile (gemm_lanes.h, AVX512-BF16 builds): 6 against 12 at 12-33
bf16 rows over LM-head and layer-sized weights, side by side (alternating, median of 10 calls: draft_formats.median_ms),
with the rows path and the streaming read of the same weight as the floor.

    python benchmarks/lanes_channels.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draft_formats import median_ms  # noqa: E402

from backboard.ops.cpu import gemm  # noqa: E402

SHAPES = ((248320, 512), (49152, 576), (4096, 512), (1536, 576))
ROWS = (12, 16, 20, 24, 32, 33)
REPS = 10


def main() -> None:
    mod = gemm.module()
    if mod is None or mod.lanes_channels() == 0:
        raise SystemExit(f"no lanes kernel on this CPU ({mod.isa() if mod else 'no kernels'})")
    kept = mod.lanes_channels()
    print(f"{mod.isa()}, {torch.get_num_threads()} threads, setting here: {kept} channels")
    torch.manual_seed(0)
    try:
        for N, K in SHAPES:
            w = torch.randn(N, K).bfloat16()
            gb = N * K * 2 / 1e9
            for M in ROWS:
                x = torch.randn(M, K).bfloat16()
                t = {6: [], 12: []}
                for nc in (6, 12, 6, 12):
                    mod.set_lanes_channels(nc)
                    t[nc].append(median_ms(lambda: mod.linear_bf16(x, w, None, True, False, True, True), REPS))
                rows = median_ms(lambda: mod.linear_bf16(x, w, None, True, False, False, True), REPS)
                print(f"N={N} K={K} M={M}: lanes 6 channels {'/'.join(f'{v:.3f}' for v in t[6])} ms, "
                      f"12 channels {'/'.join(f'{v:.3f}' for v in t[12])} ms, rows path {rows:.3f} ms")
            probe = median_ms(lambda: mod.sum_bf16(w), REPS)
            print(f"  floor: reading the weight {probe:.3f} ms ({gb / probe * 1e3:.1f} GB/s)")
    finally:
        mod.set_lanes_channels(kept)


if __name__ == "__main__":
    main()
