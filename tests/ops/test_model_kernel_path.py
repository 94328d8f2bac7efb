"""The whole model through the Triton kernels (interpreted on CPU) against the torch path: the
layers' wiring of ops/dispatch is what the GPU runs."""

from __future__ import annotations

import numpy as np
import torch

from backboard.forward_context import set_forward_context
from backboard.ops import dispatch
from backboard.worker.input_batch import BatchRequest, prepare_batch
from tests.models.driver import FlatBatchDriver


def _mixed_step(d: FlatBatchDriver, mode: str):
    """Prefill three requests, then one step with a decode, a 3-row verify group and a prefill
    chunk. Returns the logits of every row of the second step and the GDN states."""
    rng = np.random.default_rng(0)
    p = [rng.integers(0, 1000, n).tolist() for n in (9, 14, 21)]
    with dispatch.override(mode):
        d.step([(0, p[0]), (1, p[1]), (2, p[2][:12])])
        batch = []
        for rid, toks, spec in ((0, [5], None), (1, [7, 8, 9], [d.reqs[1]["slot"], 13, 14]),
                                (2, p[2][12:], None)):
            r = d.reqs[rid]
            need = -(-(r["computed"] + len(toks)) // d.block_size)
            while len(r["blocks"]) < need:
                r["blocks"].append(int(d.free_blocks.pop()))
            batch.append(BatchRequest(np.array(toks), r["computed"], list(r["blocks"]), r["slot"], spec))
        pb = prepare_batch(batch, d.block_size)
        with torch.no_grad(), set_forward_context(pb.meta, d.caches):
            h = d.model(pb.input_ids, pb.meta.positions)
            logits = d.model.compute_logits(h)
    return logits, d.caches.ssm.clone(), d.caches.conv.clone()


def test_kernel_path_matches_torch_path(hybrid_model, monkeypatch):
    ref = _mixed_step(FlatBatchDriver(hybrid_model, block_size=8, num_blocks=64, num_slots=16), "torch")
    used = set()
    orig = dispatch._kernels
    monkeypatch.setattr(dispatch, "_kernels", lambda name: used.add(name) or orig(name))
    got = _mixed_step(FlatBatchDriver(hybrid_model, block_size=8, num_blocks=64, num_slots=16), "triton")
    assert used >= {"gdn_decode", "gdn_prefill", "rope", "attention", "norm", "activation"}, used
    scale = float(ref[0].abs().max())
    assert (got[0] - ref[0]).abs().max() <= 2e-4 * scale
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-4, atol=1e-4)
