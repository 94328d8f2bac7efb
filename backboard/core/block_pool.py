"""Paged KV blocks: reference counts, a free queue in eviction order, and (with prefix caching) a
map from block hash to the block that holds that prefix's KV.

A block is in exactly one of three states:
- owned: ref > 0 (running requests' block tables and prefix-cache checkpoints hold references);
- cached-free: ref 0, in the free queue, and still registered under its hash: a later request
  with the same prefix takes it back (`touch`) instead of recomputing it;
- free: ref 0, in the free queue, no hash.
`allocate` takes blocks from the head of the free queue; a cached-free block taken there is
evicted (its hash forgotten). Blocks freed go to the tail, and so does a cached-free block a hit
copies from without sharing it (`refresh`), so the least recently used cached block is evicted
first (LRU). A request's blocks are freed last-block-first: the tail of a sequence,
the least likely part to be shared, is evicted before its prefix.

Only full blocks whose KV is final get a hash (KVCacheManager.cache_full_blocks). When a block's
hash is already registered (two requests computed the same block), the second block stays
unregistered: block tables are append-only, so nobody's block ids change."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head: evicted first
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (free and cached-free)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} KV blocks: {len(self._free)} free")
        out = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            self._ref[b] = 1
            if self._hash[b] is not None:
                self._evict(b)
        return out

    def _evict(self, b: int) -> None:
        del self._cached[self._hash[b]]
        self._hash[b] = None
        self.num_evicted += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; pass them in eviction order (first evicted
        first): callers free a sequence's blocks last-block-first."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on blocks found in the cache (a cached-free block leaves the
        free queue)."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def refresh(self, blocks: Iterable[int]) -> None:
        """Mark cached-free blocks as just used (to the free queue's tail: evicted last). For a
        block a hit only copies from (the partial block of a chain): no reference is taken, so
        without this it would age out while every request still resumes from it."""
        for b in blocks:
            if self._ref[b] == 0:
                self._free.move_to_end(b)

    def num_reclaimed_by_touch(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` are cached-free: touching them takes them out of the free queue."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    # ---- the hash map --------------------------------------------------------------------
    def cached_block(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def cached_chain(self, hashes: Iterable[bytes]) -> list[int]:
        """The blocks of the longest prefix of `hashes` (a request's chained block hashes) that
        is cached."""
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def cache_block(self, block: int, block_hash: bytes) -> bool:
        """Register an owned full block under its hash; False (nothing changes) when that hash is
        already registered or the block already has one."""
        if block_hash in self._cached or self._hash[block] is not None:
            return False
        if self._ref[block] <= 0:
            raise RuntimeError(f"KV block {block} is cached while free")
        self._cached[block_hash] = block
        self._hash[block] = block_hash
        return True

    def reset_cache(self) -> int:
        """Forget every cached-free block's hash (owned blocks keep theirs). Returns how many."""
        n = 0
        for b in self._free:
            if self._hash[b] is not None:
                self._evict(b)
                n += 1
        return n

    # ---- checks --------------------------------------------------------------------------
    def check_integrity(self, owners: list[list[int]] | None = None) -> None:
        """Every block is either in the free queue with ref 0, or owned; the hash map and the
        per-block hashes agree; `owners` (every holder's block list: live requests, checkpoints)
        must account exactly for the reference counts."""
        free = list(self._free)
        for b in free:
            if self._ref[b] != 0:
                raise AssertionError(f"free KV block {b} has ref count {self._ref[b]}")
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        if any(self._ref[b] < 0 for b in range(self.num_blocks)):
            raise AssertionError("a KV block has a negative ref count")
        if len(used) + len(free) != self.num_blocks:
            raise AssertionError("KV blocks leaked: neither free nor referenced")
        for h, b in self._cached.items():
            if self._hash[b] != h:
                raise AssertionError(f"hash map points at KV block {b}, which has another hash")
        if sum(h is not None for h in self._hash) != len(self._cached):
            raise AssertionError("a KV block has a hash the map does not know")
        if not self.enable_caching and self._cached:
            raise AssertionError("blocks cached with prefix caching off")
        if owners is not None:
            counts: dict[int, int] = {}
            for blocks in owners:
                for b in blocks:
                    counts[b] = counts.get(b, 0) + 1
            if set(counts) != used or any(self._ref[b] != c for b, c in counts.items()):
                raise AssertionError("KV block owners do not match the reference counts")
