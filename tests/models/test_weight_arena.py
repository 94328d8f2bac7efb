"""A CPU model's weights in one allocation (models/weight_arena.py): every parameter and buffer a
view of it, in registration order, cache-line aligned, none overlapping, the values those of a
model loaded without packing, tensors on one allocation still sharing it."""

from __future__ import annotations

import pytest
import torch

from backboard.config import ModelConfig
from backboard.models import loader
from backboard.models.weight_arena import ALIGN, arena_of, pack_weights


def _load(path: str, packed: bool, monkeypatch) -> torch.nn.Module:
    with monkeypatch.context() as m:
        if not packed:
            m.setattr(loader, "pack_weights", lambda model: 0)
        return loader.load_model(ModelConfig.from_pretrained(path, dtype="bfloat16"))


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_one_allocation_in_order_aligned_and_disjoint(tiny_models, arch, monkeypatch):
    model = _load(tiny_models(arch), True, monkeypatch)
    ts = _tensors(model)
    base = arena_of(ts[0])
    assert all(arena_of(t) == base for t in ts)
    spans, seen = [], set()
    for t in ts:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        assert (t.data_ptr() - base) % ALIGN == 0
        spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
    assert spans == sorted(spans)                           # registration order
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_values_are_the_unpacked_models(tiny_models, arch, monkeypatch):
    packed, plain = _load(tiny_models(arch), True, monkeypatch), _load(tiny_models(arch), False, monkeypatch)
    assert len({arena_of(t) for t in _tensors(plain)}) > 1    # the control: separate allocations
    a, b = packed.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_tensors_on_the_same_memory_share_one_slot():
    """Two parameters on one allocation (a tie by storage rather than by object) keep sharing it,
    stored once; the arena is the distinct tensors, each rounded up to ALIGN bytes."""
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.randn(100, 9), requires_grad=False)
    m.b = torch.nn.Parameter(m.a.data, requires_grad=False)
    m.c = torch.nn.Parameter(torch.randn(5).bfloat16(), requires_grad=False)
    a, c = m.a.clone(), m.c.clone()
    total = pack_weights(m)
    assert m.a.data_ptr() == m.b.data_ptr() != m.c.data_ptr()
    assert total == -(-3600 // ALIGN) * ALIGN + ALIGN
    assert torch.equal(m.a, a) and torch.equal(m.b, a) and torch.equal(m.c, c)
