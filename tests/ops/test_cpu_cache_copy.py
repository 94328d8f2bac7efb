"""The prefix cache's slice copies in C++ (ops/cpu/cache_copy.h) against the torch reference
(ops/cache_copy.py): KV blocks along dim 0, GDN state slots along dim 1, several tensors at
once, copies that commute and chains that must run in order; bad arguments are ValueErrors."""

from __future__ import annotations

import pytest
import torch

from backboard.forward_context import ModelCaches
from backboard.ops.cache_copy import copy_slices_ref
from backboard.ops.cpu import decode_ops
from backboard.ops.cpu.build import cpu_isa
from backboard.worker.cache_ops import apply_cache_copies
from tests.ops.cpu_isas import built, isa_param

INDEPENDENT = [(0, 5), (3, 1), (7, 2)]
CHAIN = [(0, 4), (4, 6), (6, 0), (2, 2)]        # 4 read after written, 0 overwritten after read, a no-op


def _pair(shapes, dtype):
    torch.manual_seed(0)
    if dtype.is_floating_point:
        ts = [torch.randn(s).to(dtype) for s in shapes]
    else:
        ts = [torch.randint(-100, 100, s, dtype=dtype) for s in shapes]
    return ts, [t.clone() for t in ts]


@isa_param
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("copies", [INDEPENDENT, CHAIN], ids=["independent", "chain"])
def test_kv_blocks_along_dim0(isa, dtype, copies):
    built(isa)
    shapes = [(9, 16, 3, 64), (9, 16, 1, 24), (9, 5, 2, 7)]       # odd block sizes and widths too
    ours, ref = _pair(shapes, dtype)
    decode_ops.copy_slices(ours, copies, 0, isa=isa)
    copy_slices_ref(ref, copies, 0)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    orig = _pair(shapes, dtype)[0][0]
    s, d = copies[0]                                   # the copies did something
    assert torch.equal(ours[0][d], orig[s]) and not torch.equal(orig[d], orig[s])


@isa_param
@pytest.mark.parametrize("copies", [INDEPENDENT, CHAIN], ids=["independent", "chain"])
def test_state_slots_along_dim1(isa, copies):
    built(isa)
    shapes = [(3, 9, 3, 40), (3, 9, 2, 8, 8)]                     # conv, recurrent state
    ours, ref = _pair(shapes, torch.float32)
    decode_ops.copy_slices(ours, copies, 1, isa=isa)
    copy_slices_ref(ref, copies, 1)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@isa_param
def test_large_copies_split_over_threads_stay_exact(isa):
    built(isa)
    ours, ref = _pair([(40, 16, 8, 128)] * 3, torch.bfloat16)   # 32 KB a block, 16 pairs: tasks on both threads
    copies = [(i, 20 + i) for i in range(16)]
    decode_ops.copy_slices(ours, copies, 0, isa=isa)
    copy_slices_ref(ref, copies, 0)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


@isa_param
def test_bad_arguments_are_value_errors(isa):
    built(isa)
    t = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="out of range"):
        decode_ops.copy_slices([t], [(0, 4)], 0, isa=isa)
    with pytest.raises(ValueError, match="contiguous"):
        decode_ops.copy_slices([t.t()], [(0, 1)], 0, isa=isa)
    with pytest.raises(ValueError, match="dim must be 0 or 1"):
        decode_ops.copy_slices([t], [(0, 1)], 2, isa=isa)
    assert torch.count_nonzero(t) == 0


def test_runner_copies_go_through_the_dispatch(monkeypatch):
    """apply_cache_copies (what a step does first) on CPU caches: one C++ call per cache kind,
    the same result as the reference."""
    built(cpu_isa())
    calls = []
    real = decode_ops.copy_slices
    monkeypatch.setattr(decode_ops, "copy_slices",
                        lambda ts, copies, dim, **kw: (calls.append(dim), real(ts, copies, dim, **kw)))
    kv, kv_ref = _pair([(6, 4, 2, 8)] * 2, torch.bfloat16)
    st, st_ref = _pair([(2, 5, 3, 8), (2, 5, 2, 4, 4)], torch.float32)
    caches = ModelCaches(k=[kv[0]], v=[kv[1]], conv=st[0], ssm=st[1])
    apply_cache_copies(caches, [(1, 3), (3, 0)], [(0, 4)])
    copy_slices_ref(kv_ref, [(1, 3), (3, 0)], 0)
    copy_slices_ref(st_ref, [(0, 4)], 1)
    assert torch.equal(caches.k[0], kv_ref[0]) and torch.equal(caches.v[0], kv_ref[1])
    assert torch.equal(caches.conv, st_ref[0]) and torch.equal(caches.ssm, st_ref[1])
    assert calls == [0, 1]
