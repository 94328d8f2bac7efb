"""CUDA graphs for decode and verify steps: the only place that knows about them.

A step whose requests all form one uniform group (B requests x L rows: decode L = 1, verify
L = 1 + k) and nothing else is replayed from a graph captured for the smallest size B' >= B;
the B' - B padding requests point at a scratch KV block and a scratch state slot, so they touch
no real request. Mixed steps (prefill chunks) run eagerly, and so do steps with a request that
starts from an empty state (a one-token prompt's first step).

Everything a captured forward reads lives in static buffers that `run` refills: token ids,
positions, slot mapping, block table, sequence lengths, state slots (and verify destinations).
The attention kernel is captured with a split count that depends on the batch size only; each
request's split ranges are computed on the device from its sequence length at replay, so a short
context spreads over all splits as it would eagerly (ops/triton/attention.py). max_model_len only
bounds the block table."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from backboard.forward_context import ForwardMeta, ModelCaches, UniformGroup, set_forward_context

logger = logging.getLogger(__name__)


def capture_sizes(max_rows: int, max_reqs: int, L: int) -> list[int]:
    """Request counts to capture for L rows each: 1, 2, 4, 8, then steps of 8 up to 64, then of 16,
    while B * L <= max_rows and B <= max_reqs."""
    sizes = [b for b in (1, 2, 4) if b * L <= max_rows and b <= max_reqs]
    b = 8
    while b * L <= max_rows and b <= max_reqs:
        sizes.append(b)
        b += 8 if b < 64 else 16
    if max_reqs * L <= max_rows and (not sizes or sizes[-1] < max_reqs):
        sizes.append(max_reqs)
    return sizes


def bucket(sizes: list[int], B: int) -> int | None:
    """The smallest captured size >= B (None: too large for any graph)."""
    for s in sizes:
        if s >= B:
            return s
    return None


@dataclass
class StaticBatch:
    """The buffers one captured graph reads (B requests x L rows) and its output."""

    B: int
    L: int
    input_ids: torch.Tensor        # [B*L]
    positions: torch.Tensor        # [B*L]
    slot_mapping: torch.Tensor     # [B*L]
    block_table: torch.Tensor      # [B, M] int32
    seq_lens: torch.Tensor         # [B] int32
    state_slots: torch.Tensor      # [B]
    has_init: torch.Tensor         # [B] bool
    dst_slots: torch.Tensor | None  # [B, L] (verify) or None
    meta: ForwardMeta
    hidden: torch.Tensor | None = None

    @classmethod
    def allocate(cls, B: int, L: int, max_blocks: int, max_seq_len: int, device) -> "StaticBatch":
        z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        sb = cls(B, L, z(B * L), z(B * L), z(B * L), z(B, max_blocks, dt=torch.int32),
                 torch.full((B,), L, dtype=torch.int32, device=device), z(B),
                 z(B, dt=torch.bool), z(B, L) if L > 1 else None, meta=None)  # type: ignore[arg-type]
        qsl = np.arange(B + 1, dtype=np.int64) * L
        sb.meta = ForwardMeta(
            num_tokens=B * L, positions=sb.positions, slot_mapping=sb.slot_mapping,
            block_table=sb.block_table, seq_lens=sb.seq_lens,
            # host-side bound for the block table; the kernels split by the device seq_lens
            seq_lens_cpu=np.full(B, max_seq_len, dtype=np.int64), query_start_loc_cpu=qsl,
            state_slots=sb.state_slots, has_initial_state=sb.has_init,
            has_initial_state_cpu=np.ones(B, dtype=bool),
            groups=[UniformGroup(0, B, L, 0, sb.dst_slots)], prefill_start=B)
        return sb

    def fill(self, input_ids: torch.Tensor, meta: ForwardMeta, scratch_block: int, scratch_slot: int,
             block_size: int) -> None:
        """Copy a live uniform batch of n <= B requests in; pad the rest onto the scratch block and
        slot."""
        n = meta.num_reqs
        T = n * self.L
        self.input_ids[:T].copy_(input_ids)
        self.input_ids[T:].zero_()
        self.positions[:T].copy_(meta.positions)
        self.positions[T:].zero_()
        self.slot_mapping[:T].copy_(meta.slot_mapping)
        self.slot_mapping[T:] = scratch_block * block_size
        M = meta.block_table.shape[1]
        self.block_table[:n, :M].copy_(meta.block_table)
        self.block_table[:n, M:] = scratch_block
        self.block_table[n:] = scratch_block
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:] = self.L
        self.state_slots[:n].copy_(meta.state_slots)
        self.state_slots[n:] = scratch_slot
        self.has_init[:n].copy_(meta.has_initial_state)
        self.has_init[n:] = False
        if self.dst_slots is not None:
            self.dst_slots[:n].copy_(meta.groups[0].dst_slots)
            self.dst_slots[n:] = scratch_slot


def uniform_shape(meta: ForwardMeta) -> tuple[int, int] | None:
    """(B, L) when the step is one uniform group and nothing else."""
    if len(meta.groups) != 1 or meta.num_prefills:
        return None
    g = meta.groups[0]
    return g.num_reqs, g.L


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, caches: ModelCaches, *, Ls: list[int], max_rows: int,
                 max_reqs: int, max_blocks: int, max_seq_len: int, block_size: int,
                 scratch_block: int, scratch_slot: int, device: torch.device) -> None:
        self.model, self.caches = model, caches
        self.block_size, self.scratch_block, self.scratch_slot = block_size, scratch_block, scratch_slot
        self.sizes = {L: capture_sizes(max_rows, max_reqs, L) for L in Ls}
        self.max_blocks, self.max_seq_len, self.device = max_blocks, max_seq_len, device
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, StaticBatch]] = {}
        self.pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs reuse the pool)."""
        for L, sizes in self.sizes.items():
            for B in sorted(sizes, reverse=True):
                sb = StaticBatch.allocate(B, L, self.max_blocks, self.max_seq_len, self.device)
                sb.block_table.fill_(self.scratch_block)
                sb.slot_mapping.fill_(self.scratch_block * self.block_size)
                sb.state_slots.fill_(self.scratch_slot)
                if sb.dst_slots is not None:
                    sb.dst_slots.fill_(self.scratch_slot)
                with set_forward_context(sb.meta, self.caches):
                    for _ in range(2):                     # compile / warm the kernels
                        self.model(sb.input_ids, sb.positions)
                    torch.cuda.synchronize(self.device)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool):
                        sb.hidden = self.model(sb.input_ids, sb.positions)
                    if self.pool is None:
                        self.pool = g.pool()
                self.graphs[(B, L)] = (g, sb)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs: %s", len(self.graphs),
                    {L: s for L, s in self.sizes.items()})

    def can_run(self, meta: ForwardMeta) -> bool:
        """A uniform step of a captured size whose requests all continue from a state (a
        one-token prompt's first step starts from zeros: eager)."""
        shape = uniform_shape(meta)
        return (shape is not None and shape[1] in self.sizes and bool(meta.has_initial_state_cpu.all())
                and bucket(self.sizes[shape[1]], shape[0]) is not None)

    def run(self, input_ids: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """Replay the graph for this step; returns the hidden states [B*L, H] (a view of the
        graph's output buffer, valid until the next replay)."""
        B, L = uniform_shape(meta)  # type: ignore[misc]
        g, sb = self.graphs[(bucket(self.sizes[L], B), L)]
        sb.fill(input_ids, meta, self.scratch_block, self.scratch_slot, self.block_size)
        g.replay()
        return sb.hidden[:B * L]
