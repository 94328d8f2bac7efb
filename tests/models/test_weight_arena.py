"""A CPU model's weights in one allocation (models/weight_arena.py): every parameter and buffer a
view of it, in registration order, cache-line aligned, none overlapping, the values those of a
model loaded without packing, tied weights still one tensor."""

from __future__ import annotations

import pytest
import torch

from backboard.config import ModelConfig
from backboard.models import loader
from backboard.models.weight_arena import ALIGN, arena_of


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


def test_tied_embedding_stays_one_tensor(tiny_models, monkeypatch):
    model = _load(tiny_models("llama"), True, monkeypatch)
    emb = model.model.embed_tokens.weight if hasattr(model, "model") else model.embed_tokens.weight
    head = model.lm_head.weight
    assert emb.data_ptr() == head.data_ptr()
