#!/usr/bin/env python
"""Kernel launches per engine step, counted on the CPU: what an eager GPU step would launch.

    python benchmarks/launch_count.py [CHECKPOINT] [--json OUT]   # default: builds the tiny hybrid

The model's forward runs on CPU tensors with dispatch forced to Triton while the Triton launches
are recorded, not run (ops/triton/host_compile.py); torch ops are counted with a dispatch mode
(every op that is not a view, an allocation or metadata is one GPU kernel launch, a host-to-device
copy included). Prints launches per step and per layer kind for a decode step (B = 4), a verify
step (B = 4, L = 4) and a mixed step (decodes + a prefill chunk). The floor is the Triton
kernels alone; everything else is torch glue a CUDA graph hides and an eager step pays for
(about 4-8 us of CPU each).
Counts, not timings: they are exact on any machine."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

FREE = ("empty", "empty_like", "empty_strided", "new_empty", "detach", "alias", "lift_fresh",
        "_unsafe_view", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size")


class OpCounter(TorchDispatchMode):
    """Counts the torch ops that launch a GPU kernel (not views, allocations or metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (getattr(func, "is_view", False) or name in FREE):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_steps(ckpt: str) -> dict[str, dict]:
    """{step kind: {"triton": n, "torch": n, "torch_ops": Counter}} for one step of each kind."""
    from backboard.ops import dispatch
    from backboard.ops.triton.host_compile import recording
    from tests.ops.served_keys import Run
    run = Run(ckpt)
    run.step([(0, 9, 0), (1, 20, 0), (2, 12, 0), (3, 7, 0)])          # prefill (not counted)
    out = {}
    kinds = {"decode B=4": [(i, 1, 0) for i in range(4)],
             "verify B=4 L=4": [(i, 4, 4) for i in range(4)],
             "mixed 3 decodes + 1 prefill chunk": [(0, 1, 0), (1, 1, 0), (2, 1, 0), (3, 16, 0)]}
    for kind, work in kinds.items():
        with recording(90, 132) as rec, dispatch.override("triton"), OpCounter() as oc:
            run.step(work)
        out[kind] = dict(triton=rec.launches, torch=sum(oc.ops.values()), torch_ops=oc.ops)
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("launch_count: unset TRITON_INTERPRET")
    args = sys.argv[1:]
    out_json = args[args.index("--json") + 1] if "--json" in args else None
    ckpt = args[0] if args and args[0] != "--json" else None
    if ckpt is None:
        import tempfile

        from backboard.models.tiny import build_tiny_checkpoint
        ckpt = build_tiny_checkpoint(os.path.join(tempfile.mkdtemp(), "tiny"), arch="qwen3_5")
    from backboard.config import ModelConfig
    cfg = ModelConfig.from_pretrained(ckpt)
    layers = cfg.num_hidden_layers
    counts = count_steps(ckpt)
    if out_json:
        import json
        with open(out_json, "w") as f:
            json.dump({k: dict(v, torch_ops=dict(v["torch_ops"]), layers=layers) for k, v in counts.items()}, f)
    for kind, c in counts.items():
        total = c["triton"] + c["torch"]
        print(f"{kind:<36} {total:5d} launches ({c['triton']} Triton = the floor, {c['torch']} torch), "
              f"{total / layers:.1f} per layer over {layers} layers")
        print("    torch: " + ", ".join(f"{k} {v}" for k, v in c["torch_ops"].most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
