"""One allocation for a CPU model's weights, laid out in the order the forward reads them.

A decode step streams every weight once. Allocated one by one, the weights under 2 MiB (most of a
small model's: SmolLM2's q/k/v, o and down projections, the benchmark checkpoint's GDN
projections) sit on 4 KiB pages, because torch's CPU allocator asks for transparent huge pages only
for allocations of 2 MiB and more: a TLB miss every 4 KiB, and the hardware prefetchers, which stop
at page boundaries, start over on every page. Separate allocations also break the stream between
one GEMM and the next. Packed into one buffer (huge pages where the kernel allows them, see
backboard/__init__.py), in registration order, which is the forward's order for our models (the
embedding, i.e. the tied LM head that ends a step, then the layers in order), the stream runs on
from one weight into the next. One request's decode GEMV over weights read from memory, 2 Zen 5
cores, separate vs packed: 512 x 512 13.6 -> 12.2 us, 960 x 576 25.3 -> 21.7, 1544 x 512 34.6 ->
29.7, 576 x 1536 35.4 -> 29.4, 4096 x 512 106.6 -> 93.6; whole decode steps at one request 2-7%
faster (the CPU benchmark checkpoint, SmolLM2), at 4 and 16 the same."""

from __future__ import annotations

import torch
from torch import nn

ALIGN = 64          # bytes: every tensor starts on a cache line (and a 512-bit vector)


def pack_weights(model: nn.Module) -> int:
    """Move the model's CPU parameters and buffers into one buffer, each a view of it in
    registration order at an ALIGN-byte offset; tensors that shared memory (tied weights) still
    share it. Tensors that are views of something larger stay where they are. -> bytes packed."""
    tensors = _packable(model)
    if not tensors:
        return 0
    offsets, total = _layout(tensors)
    arena = torch.empty(total, dtype=torch.uint8)
    filled: set[int] = set()
    for t, off in zip(tensors, offsets):
        view = arena[off:off + t.nbytes].view(t.dtype).view(t.shape)
        if off not in filled:        # tensors on the same memory share an offset: copy it once
            view.copy_(t.data)
            filled.add(off)
        t.data = view                # the old allocation is freed here (peak: one tensor extra)
    return total


def _packable(model: nn.Module) -> list[torch.Tensor]:
    """CPU parameters and buffers (each object once: nn.Module's iterators skip repeats, such as a
    tied LM head) that own their whole contiguous allocation, in registration order."""
    return [t for t in [*model.parameters(), *model.buffers()]
            if t.is_cpu and t.numel() and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.nbytes]


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets (one per tensor; tensors on the same memory get the same one) and the size."""
    offsets, at, placed = [], 0, {}
    for t in tensors:
        key = t.data_ptr()
        if key not in placed:
            placed[key] = at
            at += -(-t.nbytes // ALIGN) * ALIGN
        offsets.append(placed[key])
    return offsets, max(at, ALIGN)


def arena_of(t: torch.Tensor) -> int:
    """The address of the allocation t lives in (tests: packed weights share one)."""
    return t.untyped_storage().data_ptr()
