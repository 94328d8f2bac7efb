"""A simulated served run through the real model forward with every Triton kernel recorded, not
run (ops/triton/host_compile.py): how many distinct specialisations (= JIT compilations on a GPU)
the launchers produce. Run as a script in a process of its own (kernels imported without
TRITON_INTERPRET): python tests/ops/served_keys.py CHECKPOINT OUT.json

A warm-up runs one step of every kind (prefill, mixed, decode, verify with 2 and 4 rows, a
request starting from an empty state, the draft GEMVs at each row tile); then the contexts grow
past 2K tokens through prefill chunks, with decode and verify steps in between and groups at
different offsets of the step's arrays. On a GPU every key first seen in the second phase is a
compile stall in the middle of serving; the test requires none."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Run:
    def __init__(self, ckpt: str) -> None:
        import numpy as np

        from tests.models.driver import FlatBatchDriver
        self.np = np
        self.d = FlatBatchDriver(ckpt, dtype="bfloat16", block_size=16, num_blocks=640, num_slots=40)
        self.rng = np.random.default_rng(0)
        self.spare = {}                                    # rid -> verify destination slots

    def step(self, work: list[tuple[int, int, int]]) -> None:
        """work: [(request id, tokens this step, verify rows L or 0)]."""
        import torch

        from backboard.forward_context import set_forward_context
        from backboard.worker.input_batch import BatchRequest, prepare_batch
        d, batch = self.d, []
        for rid, n, L in work:
            r = d._req(rid)
            need = -(-(r["computed"] + n) // d.block_size)
            while len(r["blocks"]) < need:
                r["blocks"].append(int(d.free_blocks.pop()))
            dst = None
            if L:
                if rid not in self.spare:
                    self.spare[rid] = [d.free_slots.pop() for _ in range(4)]
                dst = [r["slot"]] + self.spare[rid][:L - 1]
            batch.append(BatchRequest(self.rng.integers(0, 1000, n), r["computed"], list(r["blocks"]),
                                      r["slot"], dst))
        pb = prepare_batch(batch, d.block_size)
        with torch.no_grad(), set_forward_context(pb.meta, d.caches):
            d.model.compute_logits(d.model(pb.input_ids, pb.meta.positions))
        for rid, n, _ in work:
            d.reqs[rid]["computed"] += n

    def gemvs(self, rows) -> None:
        import torch

        from backboard.ops import dispatch
        H, V = self.d.cfg.hidden_size, self.d.cfg.vocab_size
        q8, s8 = torch.empty(V, H, dtype=torch.int8), torch.empty(V)
        p4, s4 = torch.empty(H, H, dtype=torch.uint8), torch.empty(H, 2 * H // 64)
        for M in rows:
            x = torch.empty(M, 2 * H, dtype=torch.bfloat16)
            dispatch.int8_linear(x[:, :H], q8, s8, torch.float32)
            dispatch.int4_linear(x, p4, s4, 64)


def warm_up(run: Run) -> None:
    run.step([(0, 7, 0), (1, 20, 0)])                          # prefill
    run.step([(0, 1, 0), (1, 1, 0), (2, 5, 0)])                # decode group + prefill
    run.step([(0, 1, 0), (1, 1, 0), (2, 1, 0)])                # decode
    run.step([(1, 1, 0), (0, 4, 4), (2, 4, 4)])                # decode + verify (L = 4)
    run.step([(0, 2, 2), (1, 2, 2)])                           # verify (L = 2)
    run.step([(3, 1, 0), (0, 1, 0)])                           # one-token prompt: empty state
    run.gemvs([1, 17, 33])


def served(run: Run) -> None:
    """Contexts grow past 2K: block tables of 1 to 130 columns, groups at odd offsets."""
    for target in (31, 32, 33, 100, 255, 256, 257, 1000, 2047, 2049):
        for rid, lag in ((0, 0), (1, 9), (2, 130)):
            have = run.d.reqs[rid]["computed"]
            if target - lag > have:
                run.step([(rid, target - lag - have, 0)])
        run.step([(0, 1, 0), (1, 1, 0), (2, 1, 0)])
        run.step([(2, 1, 0), (0, 4, 4), (1, 4, 4)])
        run.step([(1, 1, 0), (2, 1, 0), (0, 2, 2), (3, 3, 0)])
    run.gemvs(range(1, 65))


def main(ckpt: str, out: str) -> None:
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the kernels must be JIT functions")
    sys.path.insert(0, ROOT)
    from backboard.ops import dispatch
    from backboard.ops.triton.host_compile import recording
    run = Run(ckpt)
    with recording(90, 132) as rec, dispatch.override("triton"):
        warm_up(run)
        first = dict(rec.specs)
        served(run)
    new = [s.label() for k, s in rec.specs.items() if k not in first]
    kernels = sorted({s.kernel for s in first.values()})
    with open(out, "w") as f:
        json.dump(dict(warmup_keys=len(first), kernels=kernels, new_keys=new, launches=rec.launches), f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
