"""Block tables of the attention layers: how many blocks each request needs, and allocation."""

from __future__ import annotations

from backboard.core.block_pool import BlockPool
from backboard.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

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

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []

    def usage(self) -> float:
        return self.pool.usage()

    def check_integrity(self, live: list[Request]) -> None:
        self.pool.check_integrity([r.block_ids for r in live])
