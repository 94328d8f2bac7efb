"""The draft head's weight formats against bf16, side by side, on this CPU: what
ops/cpu/gemm.INT8_LM_HEAD_ROWS_MAX and INT4_WIDENED_ISAS are set from.

  LM head      SmolLM2's 49152 x 576: INT8 (per channel) vs bf16, fp32 logits
  head layers  the draft head's linears (fc 576 x 1152, qkv, o, gate_up, down): int4 in groups of
               64 vs the same weights widened to bf16

bf16 activations (a bf16 target), 1 to 64 rows, medians of --reps calls, the two formats timed
one after the other at each row count (this VM's bandwidth drifts over minutes).

    python benchmarks/draft_formats.py [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard.ops.cpu import build, gemm  # noqa: E402
from backboard.ops.quant import quantize_int4, quantize_int8  # noqa: E402

LM_HEAD = (49152, 576)
HEAD_LAYERS = [(576, 1152), (960, 576), (576, 576), (3072, 576), (576, 1536)]
GROUP = 64


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    mod = gemm.module()
    print(f"isa {build.cpu_isa()} (running {gemm._isa_running(mod)}), threads {torch.get_num_threads()}; "
          f"now: INT8 LM head up to {gemm.int8_lm_head_rows_max(mod)} rows, "
          f"int4 widened: {gemm.int4_widened_pays(mod)}")
    torch.manual_seed(0)
    w = torch.randn(*LM_HEAD) * 0.02
    wb, (q, s) = w.bfloat16(), quantize_int8(w)
    layers = [torch.randn(n, k) * 0.02 for n, k in HEAD_LAYERS]
    widened, packed = [x.bfloat16() for x in layers], [quantize_int4(x, GROUP) for x in layers]
    print(f"{'rows':>4}  {'LM int8 ms':>10} {'LM bf16 ms':>10}  {'layers int4 ms':>14} {'layers bf16 ms':>14}")
    for R in (1, 2, 4, 8, 16, 32, 64):
        x = torch.randn(R, LM_HEAD[1]).bfloat16()
        xs = {k: torch.randn(R, k).bfloat16() for _, k in HEAD_LAYERS}
        i8 = median_ms(lambda: gemm.int8_linear(x, q, s, torch.float32, mod=mod), args.reps)
        b16 = median_ms(lambda: gemm.linear_bf16(x, wb, None, torch.float32, mod=mod), args.reps)
        i4 = median_ms(lambda: [gemm.int4_linear(xs[k], p, sc, GROUP, mod=mod)
                                for (_, k), (p, sc) in zip(HEAD_LAYERS, packed)], args.reps)
        w4 = median_ms(lambda: [gemm.linear_bf16(xs[k], b, None, mod=mod)
                                for (_, k), b in zip(HEAD_LAYERS, widened)], args.reps)
        print(f"{R:>4}  {i8:>10.2f} {b16:>10.2f}  {i4:>14.3f} {w4:>14.3f}")


if __name__ == "__main__":
    main()
