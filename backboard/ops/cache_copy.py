"""The prefix cache's copies of whole cache slices (KV blocks along dim 0 of [blocks, bs, nkv, D],
GDN state slots along dim 1 of [n_gdn, slots, ...]): the torch reference of the C++ op
(ops/cpu/cache_copy.h), which ops/dispatch.py swaps in for CPU tensors.

Semantics are sequential: each copy sees the effect of the ones before it in the list (a state
saved into a checkpoint slot and copied on to a resuming request in the same step arrives
whole). When no copy reads a slot or block another one writes, and no two write the same one,
the list is one gather and one scatter per tensor, which is the same thing."""

from __future__ import annotations

import torch


def independent(copies: list[tuple[int, int]]) -> bool:
    """No destination written twice and none read: the copies commute."""
    srcs, dsts = [s for s, _ in copies], [d for _, d in copies]
    return len(set(dsts)) == len(dsts) and not set(srcs) & set(dsts)


def copy_slices_ref(tensors: list[torch.Tensor], copies: list[tuple[int, int]], dim: int) -> None:
    """For each (src, dst) in order: t.select(dim, dst) <- t.select(dim, src), every tensor."""
    if independent(copies):
        dev = tensors[0].device
        src_i = torch.tensor([s for s, _ in copies], device=dev)
        dst_i = torch.tensor([d for _, d in copies], device=dev)
        for t in tensors:
            t.index_copy_(dim, dst_i, t.index_select(dim, src_i))
        return
    for s, d in copies:                                  # a chain: one at a time, in order
        for t in tensors:
            t.select(dim, d).copy_(t.select(dim, s))
