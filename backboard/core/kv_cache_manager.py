"""Block tables of the attention layers: how many blocks each request needs, and allocation
(fresh blocks, or a cached prefix's blocks shared by reference plus fresh ones after them)."""

from __future__ import annotations

from backboard.core.block_pool import BlockPool
from backboard.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_ids))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_blocks_needed(req, num_new_tokens))

    def allocate(self, req: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's block table to hold num_computed + num_new tokens. Returns the
        new block ids, or None (nothing allocated) when the pool is short."""
        n = self.num_blocks_needed(req, num_new_tokens)
        if not self.pool.can_allocate(n):
            return None
        new = self.pool.allocate(n)
        req.block_ids.extend(new)
        return new

    def num_short_with_prefix(self, req: Request, shared: list[int], num_new_tokens: int) -> int:
        """Blocks missing for `allocate_with_prefix` (0: it succeeds)."""
        need = max(0, -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(shared))
        return max(0, need + self.pool.num_reclaimed_by_touch(shared) - self.pool.num_free)

    def allocate_with_prefix(self, req: Request, shared: list[int], num_new_tokens: int) -> list[int] | None:
        """A request without blocks starts from cached blocks `shared` (one more reference each)
        followed by fresh blocks for num_computed + num_new tokens. Returns the fresh block ids,
        or None (nothing changed) when the pool is short."""
        if req.block_ids:
            raise RuntimeError(f"{req.request_id} already holds KV blocks")
        if self.num_short_with_prefix(req, shared, num_new_tokens):
            return None
        self.pool.touch(shared)
        req.block_ids = list(shared)
        return self.allocate(req, num_new_tokens)

    def free(self, req: Request) -> None:
        self.pool.free(reversed(req.block_ids))      # the tail of the sequence is evicted first
        req.block_ids = []

    def usage(self) -> float:
        return self.pool.usage()

    def check_integrity(self, live: list[Request], other_owners: list[list[int]] = ()) -> None:
        self.pool.check_integrity([r.block_ids for r in live] + list(other_owners))
