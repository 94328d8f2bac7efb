"""How a model parameter is built from checkpoint tensors (WeightSpec): what the model classes
declare and the loader (models/loader.py) consumes. Kept apart from the loader so that model
modules never import it (the loader imports the model registry).

Under tensor parallelism a rank reads only its slices: a source may carry a `TensorSlice` (row or
column ranges, read with safetensors' get_slice), and a parameter of a parallel layer carries a
`ParamShard` (its full checkpoint shape, its slice, the zero rows it is padded with); both are
defined in distributed/shard.py, below the layers that set them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from backboard.distributed.shard import ParamShard, TensorSlice, pad_rows

__all__ = ["ParamShard", "TensorSlice", "WeightSpec"]


@dataclass
class WeightSpec:
    """How one model parameter is built: checkpoint tensors (name, expected full shape), the
    slice of each this rank reads (None: all of it), combined."""

    sources: list[tuple[str, tuple[int, ...]]]
    combine: Callable[[list[torch.Tensor]], torch.Tensor]
    slices: list[TensorSlice | None] | None = None

    def slice_of(self, i: int) -> TensorSlice | None:
        return self.slices[i] if self.slices is not None else None

    @staticmethod
    def cat(sources: list[tuple[str, tuple[int, ...]]],
            slices: list[TensorSlice | None] | None = None) -> WeightSpec:
        """A joined projection: the parts (or this rank's slices of them) stacked along the output dim."""
        return WeightSpec(sources, lambda ts: torch.cat(ts, dim=0), slices)

    @staticmethod
    def same(name: str, shape: tuple[int, ...]) -> WeightSpec:
        return WeightSpec([(name, shape)], lambda ts: ts[0])

    @staticmethod
    def sharded(name: str, shard: ParamShard) -> WeightSpec:
        """One parameter of a parallel layer: its slice of one checkpoint tensor (padded)."""
        return WeightSpec([(name, shard.full_shape)], lambda ts: pad_rows(ts[0], shard.pad_rows),
                          [shard.slice])
