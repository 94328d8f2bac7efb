"""The scoped forward context: what every layer of one forward needs besides its input
(batch metadata and the caches). Set once per forward; contexts never nest."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from backboard.worker.attn_metadata import ForwardMeta


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
        yield _CURRENT
    finally:
        _CURRENT = None


def get_forward_context() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("no forward context: call the model inside set_forward_context()")
    return _CURRENT
