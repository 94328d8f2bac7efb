"""The contract between the model runner and the layers: the per-step batch metadata (ForwardMeta)
and the caches (ModelCaches), set once per forward as a scoped context that every layer reads.

It sits below both layers/ (which read it) and worker/ (which builds it), as vLLM's
forward_context does; it imports nothing of the engine.

The metadata contract: requests in the flat batch are ordered [uniform groups (decodes, then verify
groups) | prefills]. A uniform group is a contiguous run of requests with the same number L of
query rows, each of them the last L positions of its sequence (decode: L = 1; speculative
verification: L = 1 + k). Prefills are everything else: whole prompts or prompt chunks resumed from
the cache. Every kernel and CUDA graph keys on this order."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from backboard.ops import dispatch


@dataclass
class UniformGroup:
    req_start: int
    req_end: int
    L: int                                  # query rows per request
    tok_start: int                          # first token of the group in the flat batch
    dst_slots: torch.Tensor | None = None   # [n, L]: GDN state after each row (verify) or None

    @property
    def num_reqs(self) -> int:
        return self.req_end - self.req_start

    @property
    def tok_end(self) -> int:
        return self.tok_start + self.num_reqs * self.L


@dataclass(frozen=True)
class StateSnapshot:
    """A prefix-cache checkpoint the step takes inside a prefill span: the GDN state (conv and
    recurrent, every layer) after the span's first `offset` tokens goes to `slot` as well."""

    span: int                               # prefill request index (0: the request at prefill_start)
    offset: int                             # 0 < offset < the span's tokens
    slot: int


@dataclass
class ForwardMeta:
    """Shapes: T tokens, B requests, M blocks per block-table row."""

    num_tokens: int
    positions: torch.Tensor                 # [T] int64
    slot_mapping: torch.Tensor              # [T] int64: KV cache slot of each token
    block_table: torch.Tensor               # [B, M] int32
    seq_lens: torch.Tensor                  # [B] int32: tokens after this step (context + new)
    seq_lens_cpu: np.ndarray                # [B]
    query_start_loc_cpu: np.ndarray         # [B + 1]
    state_slots: torch.Tensor               # [B] int64: GDN slot read (initial state) / written
    has_initial_state: torch.Tensor         # [B] bool: num_computed_tokens > 0
    has_initial_state_cpu: np.ndarray       # [B]
    groups: list[UniformGroup] = field(default_factory=list)
    prefill_start: int = 0                  # first prefill request (== B when none)
    state_snapshots: list[StateSnapshot] = field(default_factory=list)   # by span, then offset

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def prefill_tok_start(self) -> int:
        return int(self.query_start_loc_cpu[self.prefill_start])

    def prefill_cu_seqlens(self) -> list[int]:
        """Token offsets of the prefill requests, relative to the first prefill token."""
        q = self.query_start_loc_cpu[self.prefill_start:]
        return (q - q[0]).tolist()

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.prefill_start


@dataclass
class ModelCaches:
    """KV caches of the attention layers (by attention-layer ordinal) and the GDN states (by GDN
    layer ordinal): conv [n_gdn, slots, K-1, C] (model dtype), ssm [n_gdn, slots, nv, dk, dv] fp32."""

    k: list[torch.Tensor]                   # each [num_blocks, block_size, nkv, D]
    v: list[torch.Tensor]
    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


@dataclass
class ForwardContext:
    meta: ForwardMeta
    caches: ModelCaches


_CURRENT: ForwardContext | None = None


@contextmanager
def set_forward_context(meta: ForwardMeta, caches: ModelCaches) -> Iterator[ForwardContext]:
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("forward contexts do not nest")
    _CURRENT = ForwardContext(meta, caches)
    try:
        with dispatch.fixed_selection():         # kernel choices read once per forward
            yield _CURRENT
    finally:
        _CURRENT = None


def get_forward_context() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("no forward context: call the model inside set_forward_context()")
    return _CURRENT
