"""The prefix cache's copies (SchedulerOutput.kv_block_copies / state_copies), made at the start
of a step, before its forward overwrites anything.

Semantics are sequential: each copy sees the effect of the ones before it in its list (a state
saved into a checkpoint slot and copied on to a resuming request in the same step arrives
whole). When no copy reads a slot or block another one writes, and no two write the same one, a
list is made as one gather and one scatter per cache tensor, which is the same thing."""

from __future__ import annotations

import torch

from backboard.forward_context import ModelCaches


def apply_cache_copies(caches: ModelCaches, kv_block_copies: list[tuple[int, int]],
                       state_copies: list[tuple[int, int]]) -> None:
    if kv_block_copies:
        # every attention layer's K and V, the proposer's layers included: [blocks, bs, nkv, D]
        _copy_rows(caches.k + caches.v, kv_block_copies, dim=0)
    if state_copies:
        # conv [n_gdn, slots, K-1, C] and recurrent state [n_gdn, slots, nv, dk, dv]
        _copy_rows([caches.conv, caches.ssm], state_copies, dim=1)


def _copy_rows(tensors: list[torch.Tensor], copies: list[tuple[int, int]], dim: int) -> None:
    srcs, dsts = [s for s, _ in copies], [d for _, d in copies]
    if len(set(dsts)) == len(dsts) and not set(srcs) & set(dsts):
        dev = tensors[0].device
        src_i, dst_i = torch.tensor(srcs, device=dev), torch.tensor(dsts, device=dev)
        for t in tensors:
            t.index_copy_(dim, dst_i, t.index_select(dim, src_i))
        return
    for s, d in copies:                                  # a chain: one at a time, in order
        for t in tensors:
            t.select(dim, d).copy_(t.select(dim, s))
