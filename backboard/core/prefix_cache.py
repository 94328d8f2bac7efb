"""Prefix caching for plain and hybrid models: KV blocks by chained hash, GDN state checkpoints.

Plain models (vLLM v1 style). Every full block of `block_size` tokens has a hash chained over the
whole prefix: h_i = sha256(h_{i-1} || token ids of block i). A block is registered under its hash
(BlockPool) once its KV is final: all its positions are below the request's num_computed_tokens
after the step's rejected drafts were rolled back, so a cached block never holds KV written for a
rejected draft. A new request takes the longest chain of cached blocks by reference and resumes
after it; freed cached blocks stay reusable in an LRU free queue until allocation evicts them.

Hybrid models. A Gated DeltaNet layer's state is valid only at the exact position where it was
taken, so a request can resume at position p only from a state checkpoint for exactly tokens[0:p]
(the conv + recurrent state of every GDN layer, in a state slot) plus the KV of every position
< p. A checkpoint pins (holds a reference on) the blocks holding that KV: p // bs full blocks and,
when p is not block-aligned, the partial block holding positions (p // bs) * bs .. p - 1. So a
checkpoint is always usable while it exists; evicting it drops those references (the blocks stay
in the LRU as cached-free blocks).

Resuming from a checkpoint at p (decided by `lookup`, done by `allocate`):
- the full blocks are shared (one more reference each); the request never writes them;
- the partial block is copied (copy-on-write) into the request's own block at index p // bs,
  every attention layer (the proposer's too); the request writes positions >= p there;
- the checkpoint's state slot is copied into the request's first slot. The checkpoint stays.
Copies are carried to the worker in SchedulerOutput and made before the step's forward, in order.
The model computes at least one token (the logits of the last token are needed), so p <= n - 1.

The key of a checkpoint at p is tokens[0 : p + 1]: the chain hash of the p // bs full blocks and
the tail tokens[(p // bs) * bs : p + 1], the token at p included. The MTP / draft head's KV at
position p - 1 was computed from embed(token p): requiring that token to match keeps the head's
cache exactly what the new request would have computed. Checkpoints are placed where this costs
nothing: at p = n - 1 of a prompt, at the end of a finished request (the next chat turn resends
that token), and one token before a block boundary (shared by every request sharing the block).

Where checkpoints come from:
- prompt end, p = prompt_len - 1: the same prompt again recomputes one token. (At p = prompt_len
  it would serve only longer prompts.)
- finished requests, p = num_tokens - 1 (every token but the last sampled one): zero-copy, the
  request's current slot is handed to the checkpoint instead of freed. That slot holds the state
  after the last accepted verify row, which never saw a rejected draft (each verify row's state
  has its own slot). The next chat turn resends history + answer + new text: it resumes there.
- every `checkpoint_interval` tokens of a prompt (p = k * interval - 1).
- a hinted segment end, p = prefix_hint - 1: the front end passes where a chat prompt's system
  messages and tools end (server/prefix_hint.py), so the next conversation sharing them resumes
  there, even the first one to arrive after this request.
- branch points: when a new request's prefix matches cached KV blocks further than its best
  checkpoint (a shared system prompt), or the full blocks of a request waiting behind it, its
  prefill checkpoints at the last shared block's end - 1, so the next request sharing that prefix
  resumes there.
How a checkpoint at p is taken: a prefill chunk never stops at p. A chunk ending exactly at p
leaves the state in the request's slot, copied into a free slot before the next forward; a chunk
running past p gets a free slot in SchedulerOutput.state_snapshots and the step's GDN layers cut
the span at p and copy the state there (layers/state_snapshots.py); the checkpoint is made after
the step either way. (Stopping the chunk at p cost a step more: at concurrency 1 a whole pass over
the weights before the first token.)
Requests sharing a prefix that one of them is computing (a wave arriving together): a waiting
request whose best checkpoint is shorter than its shared full blocks with a running request
(a "leader") that has not computed past the branch point b = shared * block_size - 1 waits
(`wait_for_leader`): the leader's prefill gets a checkpoint at b if it lacks one, and the waiting
request is admitted once the leader's checkpoint exists (it then resumes at b) or the leader has
passed b without one (no slot for it). It never starves: the leader must be running and not
paused, and a request waits at most MAX_WAIT_STEPS steps in all. Requests behind it in the queue
are admitted meanwhile. Without this every request of the wave recomputes the shared prefix.
Requests asking for prompt logprobs never resume from the cache (they need every position).

Eviction: when state slots or blocks are short, checkpoints go first (before running requests
are preempted), by tokens saved per byte (bytes: the state slot plus the blocks it pins) aged by
recency: GreedyDual-Size, priority = L + tokens / bytes, set when a checkpoint is made or used,
the lowest priority is evicted and L rises to it. Among equal sizes this is LRU; a long prefix
nobody uses again still ages out, where a plain tokens-per-byte order would keep it forever. A
new checkpoint that would be the first to go is not made."""

from __future__ import annotations

import bisect
import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Iterable

from backboard.core.kv_cache_manager import KVCacheManager
from backboard.core.state_pool import StatePool
from backboard.request import Request

ROOT_HASH = b"backboard:prefix-root"      # the parent of a sequence's first block
MAX_WAIT_STEPS = 32                       # steps a request may wait for a leader's checkpoint, in all


def hash_block_tokens(parent: bytes, tokens) -> bytes:
    """The chained hash of one block: sha256(parent hash || token ids as int64)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def request_block_hashes(req: Request, block_size: int) -> list[bytes]:
    """Extend req.block_hashes to every full block of its known tokens (token ids only grow)."""
    hashes, toks = req.block_hashes, req.all_token_ids
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), len(toks) // block_size):
        parent = hash_block_tokens(parent, toks[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def num_shared_blocks(a: Request, b: Request, block_size: int) -> int:
    """Leading full blocks with equal chain hashes (so equal tokens) in two requests."""
    n = 0
    for x, y in zip(request_block_hashes(a, block_size), request_block_hashes(b, block_size)):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)
class StateCheckpoint:
    """The GDN state after tokens[0:num_tokens] in `slot`, and the KV blocks of those positions."""

    slot: int
    num_tokens: int               # p: a request resumes by computing position p
    parent: bytes                 # chain hash of tokens[0 : (p // bs) * bs]
    tail: list[int]               # tokens[(p // bs) * bs : p + 1]
    block_ids: list[int]          # p // bs full blocks, then the partial one when p % bs
    last_used: int = 0            # scheduler step
    priority: float = 0.0         # GreedyDual-Size: L + tokens saved per byte, when made or used
    kind: str = "prompt"          # prompt | interval | branch | finish (statistics)


class CheckpointStore:
    """Checkpoints indexed by the chain hash of their full blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_parent: dict[bytes, list[StateCheckpoint]] = {}
        self._all: dict[int, StateCheckpoint] = {}          # by slot

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self):
        return iter(list(self._all.values()))

    def add(self, ck: StateCheckpoint) -> None:
        self._by_parent.setdefault(ck.parent, []).append(ck)
        self._all[ck.slot] = ck

    def remove(self, ck: StateCheckpoint) -> None:
        bucket = self._by_parent[ck.parent]
        bucket.remove(ck)
        if not bucket:
            del self._by_parent[ck.parent]
        del self._all[ck.slot]

    def find_exact(self, parent: bytes, tail: list[int]) -> StateCheckpoint | None:
        return next((c for c in self._by_parent.get(parent, ()) if c.tail == tail), None)

    def find(self, hashes: list[bytes], tokens: list[int], max_tokens: int) -> StateCheckpoint | None:
        """The checkpoint with the most tokens (<= max_tokens) that is a prefix of `tokens`
        (whose full-block chain hashes are `hashes`)."""
        bs = self.block_size
        for j in range(min(len(hashes), max_tokens // bs), -1, -1):
            best = None
            for c in self._by_parent.get(hashes[j - 1] if j else ROOT_HASH, ()):
                if c.num_tokens <= max_tokens and (best is None or c.num_tokens > best.num_tokens) \
                        and tokens[j * bs:c.num_tokens + 1] == c.tail:
                    best = c
            if best is not None:
                return best
        return None


@dataclass(frozen=True)
class PrefixCacheSettings:
    checkpoint_interval: int = 0      # > 0: checkpoint a prompt every this many tokens
    proposer_has_kv: bool = False     # MTP / draft head: its KV at p - 1 depends on token p
    state_bytes: int = 1              # bytes of one state slot (eviction: tokens saved per byte)
    block_bytes: int = 0              # bytes of one KV block, every attention layer


@dataclass
class CacheHit:
    num_tokens: int = 0                   # positions the request does not compute
    block_ids: list[int] = field(default_factory=list)   # shared full blocks
    partial_src: int | None = None        # block copied into the request's block at p // bs
    checkpoint: StateCheckpoint | None = None
    stops: list[int] = field(default_factory=list)       # checkpoint positions of its prefill


@dataclass
class PrefixCacheStats:
    queries: int = 0                      # tokens of requests looked up
    hits: int = 0                         # of which served from the cache
    checkpoints_made: int = 0
    checkpoints_evicted: int = 0
    leader_waits: int = 0                 # steps requests waited for a leader's checkpoint


class PrefixCache:
    """What the scheduler asks of the prefix cache (see the module docstring)."""

    def __init__(self, kv: KVCacheManager, states: StatePool | None, settings: PrefixCacheSettings) -> None:
        if not kv.pool.enable_caching:
            raise ValueError("the block pool was made without caching")
        self.kv, self.states, self.settings = kv, states, settings
        self.bs = kv.block_size
        self.store = CheckpointStore(self.bs)
        self.stats = PrefixCacheStats()
        self.kv_block_copies: list[tuple[int, int]] = []
        self.state_copies: list[tuple[int, int]] = []
        self._stops: dict[str, list[int]] = {}          # request id -> checkpoint positions ahead
        self._pending: dict[str, list[tuple[int, int]]] = {}   # request id -> this step's snapshots
        self._num_registered: dict[str, int] = {}       # request id -> blocks registered
        self._waited: dict[str, int] = {}               # request id -> steps waited for a leader
        self._min_tokens = self.bs                       # a checkpoint saves at least a block
        self.clock = 0                                   # steps
        self._age = 0.0                                  # GreedyDual-Size's L

    # ---- admission -----------------------------------------------------------------------
    def lookup(self, req: Request, peers: Iterable[Request] = ()) -> CacheHit:
        """Where a request without blocks resumes, and the checkpoints of its prefill (branch
        points with the cached blocks and with `peers`, the requests waiting behind it)."""
        if req.sampling_params.prompt_logprobs is not None:
            return CacheHit()
        hashes = request_block_hashes(req, self.bs)
        max_p = req.num_tokens - 1
        chain = self.kv.pool.cached_chain(hashes[:max_p // self.bs + 1])
        hit = self._hit_from_checkpoint(req, hashes, max_p) if self.states is not None \
            else self._hit_from_blocks(chain, max_p)
        if self.states is not None:
            branches = {len(chain)} | {num_shared_blocks(req, o, self.bs) for o in peers}
            hit.stops = self._stops_for(req, hit.num_tokens, branches)
        self._stops[req.request_id] = hit.stops
        return hit

    def wait_for_leader(self, req: Request, leaders: Iterable[tuple[Request, int]]) -> bool:
        """Should waiting `req` wait a step for a running leader's checkpoint at a longer shared
        prefix than any checkpoint it has now? Gives the leader a checkpoint there if needed.
        leaders: (request, tokens it had computed before this step's chunk)."""
        rid = req.request_id
        if self.states is None or req.sampling_params.prompt_logprobs is not None \
                or self._waited.get(rid, 0) >= MAX_WAIT_STEPS:
            return False
        ck = self.store.find(request_block_hashes(req, self.bs), req.all_token_ids, req.num_tokens - 1)
        have = max(ck.num_tokens if ck is not None else 0, self._min_tokens - 1)
        for b, leader, done in sorted(((num_shared_blocks(req, r, self.bs) * self.bs - 1, r, c) for r, c in leaders),
                                      key=lambda t: -t[0]):
            if b <= have:
                break
            if self._promise(leader, b, done):
                self._waited[rid] = self._waited.get(rid, 0) + 1
                self.stats.leader_waits += 1
                return True
        return False

    def _promise(self, leader: Request, b: int, done: int) -> bool:
        """Will the leader (done tokens computed before this step) checkpoint at b, in this step
        or a later one? Adds the checkpoint position."""
        stops = self._stops.get(leader.request_id)
        if stops is None or done > b:
            return False
        if b not in stops:
            if done == b:
                return False                 # already there, without a checkpoint: too late
            bisect.insort(stops, b)
        return True

    def _hit_from_blocks(self, chain: list[int], max_p: int) -> CacheHit:
        """Plain models: the cached chain itself (one token before its end with a proposer
        KV, so the head's KV at p - 1 was computed from the same token p)."""
        if not chain:
            return CacheHit()
        p = min(len(chain) * self.bs - int(self.settings.proposer_has_kv), max_p)
        j = p // self.bs
        return CacheHit(p, chain[:j], chain[j] if p % self.bs else None)

    def _hit_from_checkpoint(self, req: Request, hashes: list[bytes], max_p: int) -> CacheHit:
        ck = self.store.find(hashes, req.all_token_ids, max_p)
        if ck is None:
            return CacheHit()
        j = ck.num_tokens // self.bs
        partial = ck.block_ids[j] if ck.num_tokens % self.bs else None
        return CacheHit(ck.num_tokens, ck.block_ids[:j], partial, ck)

    def _stops_for(self, req: Request, p: int, branches: set[int]) -> list[int]:
        """Checkpoint positions ahead of p: the prompt's end, every interval, the branch points
        (after `branches` shared full blocks), the end of the hinted shared segment."""
        last = req.num_tokens - 1
        stops = set()
        if req.num_prompt_tokens - 1 <= last:
            stops.add(req.num_prompt_tokens - 1)
        if 0 < req.prefix_hint < req.num_prompt_tokens:
            stops.add(req.prefix_hint - 1)
        iv = self.settings.checkpoint_interval
        if iv > 0:
            stops.update(range(iv - 1, min(req.num_prompt_tokens - 1, last), iv))
        stops.update(min(n * self.bs - 1, last) for n in branches)
        return sorted(s for s in stops if s > p and s >= self._min_tokens)

    def allocate(self, req: Request, hit: CacheHit, num_new_tokens: int) -> list[int] | None:
        """Blocks (shared + fresh) and state slots for a request resuming at hit.num_tokens
        (already its num_computed_tokens); evicts checkpoints when short. Emits the copies. None:
        nothing allocated."""
        protect = hit.checkpoint
        if not self._make_room(lambda: self.kv.num_short_with_prefix(req, hit.block_ids, num_new_tokens),
                               lambda: self._slots_short(), protect):
            return None
        if hit.partial_src is not None:                 # copied, not shared: keep it cached as used
            self.kv.pool.refresh([hit.partial_src])
        new = self.kv.allocate_with_prefix(req, hit.block_ids, num_new_tokens)
        if self.states is not None:
            self.states.allocate(req)
        if hit.partial_src is not None:
            self.kv_block_copies.append((hit.partial_src, req.block_ids[hit.num_tokens // self.bs]))
        if hit.checkpoint is not None:
            self.state_copies.append((hit.checkpoint.slot, req.current_state_slot))
            self._use(hit.checkpoint)
        self._num_registered[req.request_id] = len(hit.block_ids)
        self._waited.pop(req.request_id, None)
        self.stats.queries += req.num_tokens
        self.stats.hits += hit.num_tokens
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit.num_tokens
        return new

    def _slots_short(self) -> int:
        if self.states is None:
            return 0
        return max(0, self.states.slots_per_request - self.states.num_free)

    # ---- checkpoints inside a chunk -----------------------------------------------------------
    def snapshots(self, req: Request, n: int) -> list[tuple[int, int]]:
        """The checkpoints req's chunk of n tokens, just scheduled (num_computed_tokens advanced
        to its end c + n), takes inside itself (stops c < p < c + n): [(p, slot)], the slot filled
        by the forward, the checkpoint made after the step (a stop at c + n is made after the step
        from the request's own slot)."""
        c, planned = req.num_computed_tokens - n, []
        for p in self._stops.get(req.request_id) or ():
            if p >= c + n:
                break
            if p > c and (slot := self._snapshot_slot(req, p)) is not None:
                planned.append((p, slot))
        if planned:
            self._pending[req.request_id] = planned
        return planned

    def _snapshot_slot(self, req: Request, p: int) -> int | None:
        """A slot for a checkpoint at p, or None (an equal one exists, or none is free)."""
        j = p // self.bs
        parent = request_block_hashes(req, self.bs)[j - 1] if j else ROOT_HASH
        old = self.store.find_exact(parent, req.all_token_ids[j * self.bs:p + 1])
        if old is not None:
            self._use(old)
            return None
        return self._free_slot_for(self._age + self._score(p, -(-p // self.bs)))

    def _settle(self, req: Request) -> None:
        """The step ran: its snapshots become checkpoints (a slot left over goes back)."""
        for p, slot in self._pending.pop(req.request_id, ()):
            if self._checkpoint(req, p, slot, self._kind(req, p)) is None:
                self.states.release(slot)

    @staticmethod
    def _kind(req: Request, p: int) -> str:
        return "prompt" if p == req.num_prompt_tokens - 1 else "interval"

    # ---- after a step --------------------------------------------------------------------
    def after_step(self, req: Request) -> None:
        """A running request's step is done (rejected drafts rolled back): register its full
        blocks, make the checkpoints its chunk took inside itself, and checkpoint its state if
        its chunk ended at a checkpoint position."""
        self._register_blocks(req)
        self._settle(req)
        stops = self._stops.get(req.request_id)
        p = req.num_computed_tokens
        while stops and stops[0] <= p:
            if stops.pop(0) == p:
                self._checkpoint(req, p, None, self._kind(req, p))

    def _register_blocks(self, req: Request) -> None:
        rid = req.request_id
        done = self._num_registered.get(rid, 0)
        full = min(req.num_computed_tokens, req.num_tokens) // self.bs
        if full <= done:
            return
        hashes = request_block_hashes(req, self.bs)
        pool = self.kv.pool
        for i in range(done, full):
            pool.cache_block(req.block_ids[i], hashes[i])
        self._num_registered[rid] = full

    def _checkpoint(self, req: Request, p: int, slot: int | None, kind: str) -> StateCheckpoint | None:
        """Checkpoint the request's state at p: into `slot` (zero-copy: a slot the request
        hands over), else a copy of its current slot into a free one."""
        j = p // self.bs
        parent = request_block_hashes(req, self.bs)[j - 1] if j else ROOT_HASH
        tail = req.all_token_ids[j * self.bs:p + 1]
        old = self.store.find_exact(parent, tail)
        if old is not None:
            self._use(old)
            return None
        blocks = req.block_ids[:-(-p // self.bs)]
        if slot is None:
            slot = self._free_slot_for(self._age + self._score(p, len(blocks)))
            if slot is None:
                return None
            self.state_copies.append((req.current_state_slot, slot))
        self.kv.pool.touch(blocks)
        ck = StateCheckpoint(slot, p, parent, list(tail), list(blocks), kind=kind)
        self._use(ck)
        self.store.add(ck)
        self.stats.checkpoints_made += 1
        return ck

    def _free_slot_for(self, priority: float) -> int | None:
        """A slot for a new checkpoint of `priority`: a free one, or the lowest-priority
        checkpoint's if that one is lower."""
        if self.states.num_free:
            return self.states.take()
        victim = self._victim(None)
        if victim is None or victim.priority >= priority:
            return None
        self._evict(victim)
        return self.states.take()

    # ---- release -------------------------------------------------------------------------
    def on_release(self, req: Request, finished: bool) -> int | None:
        """Before a request's blocks and slots are freed. A finished request hands its current
        state slot to a checkpoint: returns that slot (the caller must not free it)."""
        self._register_blocks(req)
        self._settle(req)
        self._stops.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
        self._waited.pop(req.request_id, None)
        if not finished or self.states is None or not req.state_slots:
            return None
        p = min(req.num_computed_tokens, req.num_tokens - 1)
        if p < self._min_tokens:
            return None
        ck = self._checkpoint(req, p, req.current_state_slot, "finish")
        return ck.slot if ck is not None else None

    # ---- eviction ------------------------------------------------------------------------
    def _score(self, num_tokens: int, num_blocks: int) -> float:
        s = self.settings
        return num_tokens / (s.state_bytes + num_blocks * s.block_bytes)

    def _use(self, ck: StateCheckpoint) -> None:
        ck.last_used = self.clock
        ck.priority = self._age + self._score(ck.num_tokens, len(ck.block_ids))

    def _victim(self, protect: StateCheckpoint | None) -> StateCheckpoint | None:
        """The checkpoint to evict next (never one made or used in this step)."""
        cands = [c for c in self.store if c is not protect and c.last_used < self.clock]
        return min(cands, key=lambda c: (c.priority, c.last_used), default=None)

    def _evict(self, ck: StateCheckpoint) -> None:
        self._age = max(self._age, ck.priority)
        self.store.remove(ck)
        self.kv.pool.free(reversed(ck.block_ids))
        if self.states is not None:
            self.states.release(ck.slot)
        self.stats.checkpoints_evicted += 1

    def _make_room(self, blocks_short, slots_short, protect: StateCheckpoint | None) -> bool:
        """Evict checkpoints until neither blocks nor slots are short. False (nothing evicted)
        when evicting every evictable checkpoint would not be enough."""
        if not blocks_short() and not slots_short():
            return True
        if not self._could_make_room(blocks_short(), slots_short(), protect):
            return False
        while blocks_short() or slots_short():
            self._evict(self._victim(protect))
        return True

    def _could_make_room(self, n_blocks: int, n_slots: int, protect: StateCheckpoint | None) -> bool:
        cks = [c for c in self.store if c is not protect and c.last_used < self.clock]
        if len(cks) < n_slots:
            return False
        if n_blocks == 0:
            return True
        held: dict[int, int] = {}
        for c in cks:
            for b in c.block_ids:
                held[b] = held.get(b, 0) + 1
        pool = self.kv.pool
        return sum(1 for b, n in held.items() if pool.ref_count(b) == n) >= n_blocks

    def make_room_for_blocks(self, n: int) -> bool:
        """Evict checkpoints until n more blocks can be allocated (running requests' growth)."""
        pool = self.kv.pool
        return self._make_room(lambda: max(0, n - pool.num_free), lambda: 0, None)

    def reset(self) -> None:
        """Forget every checkpoint and cached-free block."""
        for ck in self.store:
            self._evict(ck)
        self.kv.pool.reset_cache()

    # ---- the step's copies, integrity ------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        out = (self.kv_block_copies, self.state_copies)
        self.kv_block_copies, self.state_copies = [], []
        return out

    def owners(self) -> tuple[list[list[int]], list[int]]:
        """(block lists, slots) the checkpoints hold."""
        cks = list(self.store)
        return [c.block_ids for c in cks], [c.slot for c in cks]

    def check_integrity(self) -> None:
        bs = self.bs
        for c in self.store:
            if len(c.block_ids) != -(-c.num_tokens // bs) or c.num_tokens < 1:
                raise AssertionError(f"checkpoint at {c.num_tokens} holds {len(c.block_ids)} blocks")
            if len(c.tail) != c.num_tokens - (c.num_tokens // bs) * bs + 1:
                raise AssertionError(f"checkpoint at {c.num_tokens} has a tail of {len(c.tail)} tokens")
            if any(self.kv.pool.ref_count(b) < 1 for b in c.block_ids):
                raise AssertionError("a checkpoint's KV block is free")
