"""models/cpu_decode.py: a decode-only step of the tiny hybrid (and of dense Llama / Qwen3 models)
through the flat loop of C++ calls
gives the module path's logits and GDN / KV states bit for bit, runs where it should (every
decode-only bf16 step on the C++ kernels) and nowhere else (mixed steps, fp32 weights, the torch
references); gemm.decode_linear is linear_bf16 at every row count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backboard.forward_context import set_forward_context
from backboard.models import cpu_decode
from backboard.ops import dispatch
from backboard.ops.cpu import gemm
from backboard.ops.cpu.build import cpu_isa
from backboard.worker.input_batch import BatchRequest, prepare_batch
from tests.models.driver import FlatBatchDriver
from tests.ops.cpu_isas import built
from tests.ops.test_model_kernel_path import _mixed_step

ISAS = list(dict.fromkeys([cpu_isa(), "portable"]))


@pytest.fixture
def loop_runs(monkeypatch) -> list[int]:
    """The row count of every step the flat loop ran."""
    runs: list[int] = []
    orig = cpu_decode._Loop.run
    monkeypatch.setattr(cpu_decode._Loop, "run",
                        lambda self, layers, h: runs.append(h.shape[0]) or orig(self, layers, h))
    return runs


def _driver(path: str, dtype: str = "bfloat16", flat: bool = True, biases: bool = True) -> FlatBatchDriver:
    """biases=False: the attention biases dropped (the tiny Llama has them; SmolLM2's Llama has none)."""
    d = FlatBatchDriver(path, dtype=dtype, block_size=8, num_blocks=64, num_slots=16)
    d.model.cpu_decode.enabled = flat
    for layer in d.model.layers if not biases else ():
        if not layer.is_gdn:
            layer.self_attn.qkv_proj.bias = layer.self_attn.o_proj.bias = None
    return d


def _decode(d: FlatBatchDriver, prompts: list[list[int]], steps: int, mode: str = "auto", join: int = -1):
    """Prefill the prompts (one step), then `steps` decode steps of every request, each feeding
    the argmax of its last logits; at decode step `join` a new request with a one-token prompt
    joins them (a row with no initial state in the decode group, its slot not zeroed). -> (logits [R, V] of each
    decode step, GDN states and KV caches)."""
    out = []
    with dispatch.override(mode):
        last = d.step(list(enumerate(prompts)))
        for i in range(steps):
            work = [(rid, [int(lg.argmax())]) for rid, lg in last.items()]
            if i == join:                               # its slot holds a finished request's state
                g = torch.Generator().manual_seed(i)
                for t in (d.caches.ssm, d.caches.conv):
                    if t is not None:                   # a hybrid's GDN states
                        t[:, d.free_slots[-1]] = torch.randn(t[:, 0].shape, generator=g).to(t.dtype)
            last = d.step(work + ([(len(prompts), [11])] if i == join else []))
            out.append(torch.stack([last[r] for r in sorted(last)]))
    caches = (d.caches.ssm, d.caches.conv, *d.caches.k, *d.caches.v)
    return out, [t.clone() for t in caches if t is not None]


def _packed(d: FlatBatchDriver, isa: str, monkeypatch) -> FlatBatchDriver:
    """d's Linear and LM head weights with their K-interleaved copies, as the runner makes them
    where the level widens bf16 (here on any level)."""
    from backboard.layers.linear import bf16_linear_weights
    monkeypatch.setattr(gemm, "PACKED_ISAS", (isa,))
    weights = bf16_linear_weights(d.model) + [d.model.lm_head.weight]
    assert gemm.pack_widened(weights, 1 << 40, mod=gemm.module(isa)) > 0
    return d


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("num_reqs", [1, 3])
@pytest.mark.parametrize("arch", ["qwen3_5", "llama", "qwen3"])    # gated + GDN; plain (SmolLM2); q / k norm
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "k_packed"])
def test_flat_decode_matches_the_module_path_bit_for_bit(tiny_models, monkeypatch, loop_runs, isa, num_reqs, arch,
                                                         packed):
    path = tiny_models(arch)
    built(isa)
    monkeypatch.setenv("BACKBOARD_CPU_ISA", isa)
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 1000, n).tolist() for n in (9, 14, 21)[:num_reqs]]
    biases = arch != "llama"
    ref_d, got_d = _driver(path, flat=False, biases=biases), _driver(path, biases=biases)
    if packed:
        ref_d, got_d = _packed(ref_d, isa, monkeypatch), _packed(got_d, isa, monkeypatch)
    ref, ref_states = _decode(ref_d, prompts, 4, join=1)
    assert loop_runs == []
    got, states = _decode(got_d, prompts, 4, join=1)
    assert loop_runs == [num_reqs] + [num_reqs + 1] * 3     # every decode step, never the prefill
    for r, g in zip(ref, got):
        assert torch.equal(r, g), float((r - g).abs().max())
    for r, g in zip(ref_states, states):
        assert torch.equal(r, g)


def test_steps_it_does_not_cover_run_the_modules(hybrid_model, monkeypatch, loop_runs):
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    _mixed_step(_driver(hybrid_model), "auto")          # a decode, a verify group and a prefill
    prompts = [[3, 4, 5], [6, 7]]
    d = _driver(hybrid_model)
    _decode(d, prompts, 2, "torch")                     # the torch references
    _decode(_driver(hybrid_model, "float32"), prompts, 2)   # fp32 weights: F.linear, not ours
    e = _driver(hybrid_model)
    _decode(e, prompts, 0)
    with dispatch.override("auto"):
        e.step([(0, [5]), (2, [8, 9, 10])])             # one decode group and a prefill
        _verify_only(e, [0, 1])                         # one group of 3-row verifies
    assert loop_runs == []
    _decode(d, prompts, 1)                              # the same bf16 model on the kernels: it runs
    assert loop_runs == [2]


def _verify_only(d: FlatBatchDriver, rids: list[int]) -> None:
    """One step of 3-row verify groups (per-row state slots), as the speculative step sends."""
    batch, spare = [], iter(range(8, 16))
    for rid in rids:
        r = d.reqs[rid]
        need = -(-(r["computed"] + 3) // d.block_size)
        while len(r["blocks"]) < need:
            r["blocks"].append(int(d.free_blocks.pop()))
        spec = [r["slot"], next(spare), next(spare)]
        batch.append(BatchRequest(np.array([4, 5, 6]), r["computed"], list(r["blocks"]), r["slot"], spec))
    pb = prepare_batch(batch, d.block_size)
    assert len(pb.meta.groups) == 1 and pb.meta.groups[0].L == 3 and pb.meta.num_prefills == 0
    with torch.no_grad(), set_forward_context(pb.meta, d.caches):
        d.model(pb.input_ids, pb.meta.positions)


def test_a_model_with_an_uncovered_layer_is_not_eligible(hybrid_model):
    d = _driver(hybrid_model)
    layer = next(lyr for lyr in d.model.layers if not lyr.is_gdn)
    layer.self_attn.qkv_proj.bias = torch.nn.Parameter(torch.zeros(layer.self_attn.qkv_proj.out_features,
                                                                   dtype=torch.bfloat16), requires_grad=False)
    assert not d.model.cpu_decode.eligible()


@pytest.mark.parametrize("isa", ISAS)
def test_decode_linear_is_linear_bf16_at_every_row_count(isa):
    mod = gemm.module(isa)
    assert mod is not None
    torch.manual_seed(0)
    w = torch.randn(256, 2048).bfloat16()       # long rows: the panel's rounding differs in a few outputs
    rows_max = gemm._rows_max(mod, False, True)
    wp = torch.randn(300, 256).bfloat16()
    setattr(wp, gemm.K_PACKED_ATTR, mod.pack_bf16(wp))   # the K-interleaved copy: taken at every row count
    for M in sorted({1, 2, 3, 4, 5, 7, rows_max, rows_max + 1, rows_max + 9}):
        x = torch.randn(M, 2048).bfloat16()
        assert torch.equal(gemm.decode_linear(M, mod)(x, w), gemm.linear_bf16(x, w, mod=mod)), M
        assert torch.equal(gemm.decode_linear(M, mod)(x[:, :256], wp), gemm.linear_bf16(x[:, :256], wp, mod=mod)), M
