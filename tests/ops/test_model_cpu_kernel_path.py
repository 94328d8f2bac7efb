"""The whole tiny hybrid model through the C++ CPU kernels (dispatch's auto mode on CPU tensors)
against the torch path: one step with a decode row, a 3-row verify group with per-row state
slots and a prefill chunk, after three prefills (GDN prefill spans too go through gdn_decode, as
one request of L rows). This is what the CPU engine runs."""

from __future__ import annotations

import pytest
import torch

from backboard.ops import dispatch
from backboard.ops.cpu import decode_ops
from backboard.ops.cpu.build import cpu_isa
from tests.models.driver import FlatBatchDriver
from tests.ops.cpu_isas import built
from tests.ops.test_model_kernel_path import _mixed_step

# gated_rms_norm is not among them: GDN prefill spans run through gdn_decode (its norm inside)
OPS = ("gdn_decode", "paged_attention_decode", "rms_norm", "fused_add_rms_norm", "silu_mul",
       "qk_norm_rope_write_kv")
# bf16: the two paths round differently inside the fused ops (one-ulp flips) and the differences
# grow over 8 layers; fp32 agrees to float rounding
TOL = {"float32": 5e-5, "bfloat16": 5e-2}


def _driver(path: str, dtype: str) -> FlatBatchDriver:
    return FlatBatchDriver(path, dtype=dtype, block_size=8, num_blocks=64, num_slots=16)


@pytest.mark.parametrize("isa", list(dict.fromkeys([cpu_isa(), "portable"])))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_kernel_path_matches_torch_path(hybrid_model, monkeypatch, dtype, isa):
    built(isa)
    monkeypatch.setenv("BACKBOARD_CPU_ISA", isa)
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    ref = _mixed_step(_driver(hybrid_model, dtype), "torch")
    used: set[str] = set()
    for name in OPS:
        fn = getattr(decode_ops, name)
        monkeypatch.setattr(decode_ops, name,
                            lambda *a, _n=name, _f=fn, **k: used.add(_n) or _f(*a, **k))
    got = _mixed_step(_driver(hybrid_model, dtype), "auto")
    assert used == set(OPS), used
    scale = float(ref[0].float().abs().max())
    err = float((got[0].float() - ref[0].float()).abs().max())
    assert err <= TOL[dtype] * scale, (err, scale)
    torch.testing.assert_close(got[1], ref[1], rtol=TOL[dtype], atol=TOL[dtype])       # GDN states
    torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_torch_mode_never_calls_the_cpu_kernels(hybrid_model, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a CPU kernel ran under BACKBOARD_KERNELS=torch")

    for name in OPS:
        monkeypatch.setattr(decode_ops, name, boom)
    monkeypatch.setenv("BACKBOARD_KERNELS", "torch")
    logits = _mixed_step(_driver(hybrid_model, "float32"), "torch")[0]
    assert torch.isfinite(logits).all()
    assert dispatch.use_cpu_decode_ops(torch.zeros(1)) is False


def test_a_forward_reads_the_kernel_settings_once(hybrid_model, monkeypatch):
    """Kernel selection reads the environment once per forward, not at each of its kernel calls
    (266 os.environ lookups a decode step on the CPU benchmark checkpoint did cost ~0.3 ms; the
    decode ops' module lookup read $BACKBOARD_CPU_ISA at each of its ~80 calls a SmolLM2 step);
    a change made during a forward applies from the next one."""
    import os

    counts: dict[str, int] = {}
    orig = type(os.environ).__getitem__

    def counting(self, key):
        counts[key] = counts.get(key, 0) + 1
        return orig(self, key)

    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    d = _driver(hybrid_model, "bfloat16")
    _mixed_step(d, "auto")                                  # builds, warms up
    monkeypatch.setattr(type(os.environ), "__getitem__", counting)
    from backboard.forward_context import set_forward_context
    from backboard.worker.input_batch import BatchRequest, prepare_batch

    r = d.reqs[0]
    pb = prepare_batch([BatchRequest(torch.tensor([3]).numpy(), r["computed"], list(r["blocks"]), r["slot"])],
                       d.block_size)
    with torch.no_grad(), set_forward_context(pb.meta, d.caches):
        d.model.compute_logits(d.model(pb.input_ids, pb.meta.positions))
        reads = sum(counts.get(k, 0) for k in ("BACKBOARD_KERNELS", "BACKBOARD_CPU_KERNELS"))
        isa_reads = counts.get("BACKBOARD_CPU_ISA", 0)         # the decode ops' module: once
        monkeypatch.setenv("BACKBOARD_KERNELS", "torch")    # mid-forward: not seen inside it
        assert dispatch.kernel_mode() == "auto"
    assert dispatch.kernel_mode() == "torch"
    assert reads <= 2 and isa_reads <= 2, counts
