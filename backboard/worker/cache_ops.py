"""The prefix cache's copies (SchedulerOutput.kv_block_copies / state_copies), made at the start
of a step, before its forward overwrites anything: whole KV blocks of every attention layer and
whole GDN state slots, in list order (ops/cache_copy.py: each copy sees the ones before it)."""

from __future__ import annotations

from backboard.forward_context import ModelCaches
from backboard.ops import dispatch


def apply_cache_copies(caches: ModelCaches, kv_block_copies: list[tuple[int, int]],
                       state_copies: list[tuple[int, int]]) -> None:
    if kv_block_copies:
        # every attention layer's K and V, the proposer's layers included: [blocks, bs, nkv, D]
        dispatch.copy_slices(caches.k + caches.v, kv_block_copies, dim=0)
    if state_copies:
        # conv [n_gdn, slots, K-1, C] and recurrent state [n_gdn, slots, nv, dk, dv]
        dispatch.copy_slices([caches.conv, caches.ssm], state_copies, dim=1)
