"""Paged KV blocks: a free queue and reference counts (shared blocks, e.g. prefix caching, would
raise a count above 1; today every block has one owner)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} KV blocks: {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        # freed in reverse so that the tail of a sequence is reused last (as vLLM does)
        for b in reversed(blocks):
            if self._ref[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def check_integrity(self, owners: list[list[int]] | None = None) -> None:
        """Every block is either free (ref 0, once in the queue) or owned; `owners` (the block
        lists of live requests) must account exactly for the used ones."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("a KV block is in the free queue twice")
        for b in free:
            if self._ref[b] != 0:
                raise AssertionError(f"free KV block {b} has ref count {self._ref[b]}")
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        if len(used) + len(free) != self.num_blocks:
            raise AssertionError("KV blocks leaked: neither free nor referenced")
        if owners is not None:
            counts: dict[int, int] = {}
            for blocks in owners:
                for b in blocks:
                    counts[b] = counts.get(b, 0) + 1
            if set(counts) != used or any(self._ref[b] != c for b, c in counts.items()):
                raise AssertionError("KV block owners do not match the reference counts")
