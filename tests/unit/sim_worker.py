"""A simulated worker for scheduler tests: no tensors, but caches with content.

Each KV block position holds (position, token id) as the attention layers would write it, each
state slot holds the token ids a GDN state has absorbed. The worker executes SchedulerOutput's
copies and the snapshots a step takes inside a prefill chunk, checks that every request it
computes starts from caches holding exactly its own prefix (KV of every position <
num_computed_tokens, the state after exactly those tokens), then "runs" a deterministic greedy
model: verify rows write their states into verify_slot_order's slots,
drafts are accepted while they equal the model's choice. Any bookkeeping error of the scheduler
or the prefix cache shows up as a wrong cache content or as output that differs from `greedy`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from backboard.core.outputs import ModelRunnerOutput, SchedulerOutput
from backboard.core.state_pool import verify_slot_order


def next_token(tokens: list[int], vocab: int) -> int:
    """The model: a deterministic function of the whole prefix."""
    h = hashlib.blake2b(repr(tokens[-8:]).encode() + len(tokens).to_bytes(4, "little"), digest_size=4)
    return int.from_bytes(h.digest(), "little") % vocab


def greedy(prompt: list[int], n: int, vocab: int, eos: int | None = None) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(n):
        t = next_token(toks, vocab)
        toks.append(t)
        out.append(t)
        if t == eos:
            break
    return out


@dataclass
class _Req:
    tokens: list[int]
    blocks: list[int]
    slots: list[int]
    cur: int
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)


class SimWorker:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, vocab: int = 64,
                 draft_error: float = 0.0, rng=None) -> None:
        self.bs, self.vocab = block_size, vocab
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.state: list[tuple | None] = [None] * (num_slots + 1)
        self.reqs: dict[str, _Req] = {}
        self.draft_error, self.rng = draft_error, rng
        self.num_checked_resumes = 0

    # ---- the step --------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for src, dst in so.kv_block_copies:
            self.kv[dst] = list(self.kv[src])
        for src, dst in so.state_copies:
            self.state[dst] = self.state[src]
        for nr in so.new_reqs:
            cur = nr.state_slots[0] if nr.state_slots else -1
            self.reqs[nr.req_id] = _Req(list(nr.token_ids), list(nr.block_ids), list(nr.state_slots), cur)
            self.reqs[nr.req_id].num_computed = nr.num_computed_tokens
            self._check_prefix(self.reqs[nr.req_id], nr.num_computed_tokens)
        cr = so.cached_reqs
        for rid, blocks, nc in zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens):
            self.reqs[rid].blocks += blocks
            self.reqs[rid].num_computed = nc
        ids, sampled, spec = [], [], []
        for rid, n in so.num_scheduled_tokens.items():
            ids.append(rid)
            sampled.append(self._run(self.reqs[rid], n, so.spec_decode_tokens.get(rid, []),
                                     so.state_snapshots.get(rid, [])))
            spec.append(self._propose(self.reqs[rid], so.num_spec_tokens) if sampled[-1] else [])
        return ModelRunnerOutput(ids, sampled, [None] * len(ids),
                                 spec_token_ids=spec if so.num_spec_tokens else None)

    def _check_prefix(self, r: _Req, nc: int) -> None:
        """A request (re)starting at nc: KV of positions < nc and the state are its own."""
        for pos in range(nc):
            got = self.kv[r.blocks[pos // self.bs]][pos % self.bs]
            assert got == (pos, r.tokens[pos]), f"KV at {pos}: {got} != {(pos, r.tokens[pos])}"
        if r.slots and nc:
            assert self.state[r.cur] == tuple(r.tokens[:nc]), f"state at {nc} is not the request's prefix"
        if nc:
            self.num_checked_resumes += 1

    def _run(self, r: _Req, n: int, drafts: list[int], snapshots: list[tuple[int, int]]) -> list[int]:
        nc = r.num_computed
        seq = r.tokens + list(drafts)
        if r.slots and nc:
            assert self.state[r.cur] == tuple(r.tokens[:nc]), "a step starts from a wrong state"
        for pos in range(nc, nc + n):
            self.kv[r.blocks[pos // self.bs]][pos % self.bs] = (pos, seq[pos])
        if drafts:
            dst = verify_slot_order(r.slots, r.cur, n) if r.slots else []
            for j, s in enumerate(dst):
                self.state[s] = tuple(seq[:nc + j + 1])
        elif r.slots:
            self.state[r.cur] = tuple(seq[:nc + n])
        for p, slot in snapshots:                       # the state after p tokens, taken mid-chunk
            assert not drafts and nc < p < nc + n, f"snapshot at {p} outside the chunk {nc}..{nc + n}"
            assert slot not in r.slots, "a snapshot into the request's own slot"
            self.state[slot] = tuple(seq[:p])
        if nc + n < len(r.tokens):
            return []                                   # mid-prompt chunk
        out = []
        for j in range(len(drafts) + 1):                # greedy verification
            t = next_token(seq[:len(r.tokens) + j], self.vocab)
            out.append(t)
            if j == len(drafts) or drafts[j] != t:
                break
        if drafts and r.slots:
            r.cur = dst[len(out) - 1]
        r.tokens += out
        return out

    def _propose(self, r: _Req, k: int) -> list[int]:
        if not k:
            return []
        toks, out = list(r.tokens), []
        for _ in range(k):
            t = next_token(toks, self.vocab)
            if self.rng is not None and self.rng.random() < self.draft_error:
                t = (t + 1) % self.vocab
            out.append(t)
            toks.append(t)
        return out


def run_to_completion(sched, worker: SimWorker, max_steps: int = 100000, check_every: int = 0):
    """Step until idle: -> {req_id: output token ids}."""
    outs: dict[str, list[int]] = {}
    for i in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        for o in sched.update_from_output(so, worker.execute(so)):
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
        if check_every and i % check_every == 0:
            sched.check_integrity()
    return outs
