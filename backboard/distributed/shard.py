"""Which part of a split dimension a rank owns (pure arithmetic, no collectives).

Heads stay whole: a joined projection is split per part, each part by heads. KV heads fewer than
the ranks are replicated (rank r uses head r * nkv // tp). The vocabulary is split into equal
padded shards of ceil(V / tp) rows, the last one holding fewer real rows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from backboard.config import ModelConfig


def even_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's equal share of n (n divisible by size)."""
    per = n // size
    return rank * per, (rank + 1) * per


def head_range(num_heads: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the heads rank keeps: an equal share, or one replicated head when the
    heads are fewer than the ranks."""
    if num_heads >= size:
        return even_range(num_heads, size, rank)
    h = rank * num_heads // size
    return h, h + 1


def scaled(r: tuple[int, int], k: int, offset: int = 0) -> tuple[int, int]:
    """A head range -> the row range of k rows per head, shifted by offset."""
    return offset + r[0] * k, offset + r[1] * k


@dataclass(frozen=True)
class VocabShard:
    """Rows [start, end) of the vocabulary, held in `padded` rows (zeros past end - start)."""

    start: int
    end: int
    padded: int

    @staticmethod
    def of(vocab_size: int, size: int, rank: int) -> "VocabShard":
        per = -(-vocab_size // size)
        start = min(vocab_size, rank * per)
        return VocabShard(start, min(vocab_size, start + per), per)


def local_model_config(mc: ModelConfig, size: int) -> ModelConfig:
    """The head counts one rank holds (what its KV cache and GDN states are shaped by)."""
    if size == 1:
        return mc
    nkv = max(1, mc.num_key_value_heads // size)
    return replace(mc, num_attention_heads=mc.num_attention_heads // size, num_key_value_heads=nkv,
                   linear_num_key_heads=mc.linear_num_key_heads // size,
                   linear_num_value_heads=mc.linear_num_value_heads // size)


@dataclass(frozen=True)
class TensorSlice:
    """The ranges [start, end) along `dim` (0 or 1) one rank reads, concatenated in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @staticmethod
    def rows(*ranges: tuple[int, int]) -> "TensorSlice":
        return TensorSlice(0, tuple(ranges))


@dataclass(frozen=True)
class ParamShard:
    """A parameter of a parallel layer: its checkpoint tensor's full shape and this rank's slice;
    `pad_rows` zero rows follow the slice (vocabulary shards are padded to equal size)."""

    full_shape: tuple[int, ...]
    slice: TensorSlice | None
    pad_rows: int = 0


def set_shard(param: torch.nn.Parameter, full_shape: Sequence[int], slice: TensorSlice | None,
              pad_rows: int = 0) -> None:
    param.shard = ParamShard(tuple(full_shape), slice, pad_rows)


def pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if n == 0 else torch.cat([t, t.new_zeros((n,) + tuple(t.shape[1:]))])
