"""How a model parameter is built from checkpoint tensors (WeightSpec): what the model classes
declare and the loader (models/loader.py) consumes. Kept apart from the loader so that model
modules never import it (the loader imports the model registry)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class WeightSpec:
    """How one model parameter is built: checkpoint tensors (name, expected shape), combined."""

    sources: list[tuple[str, tuple[int, ...]]]
    combine: Callable[[list[torch.Tensor]], torch.Tensor]

    @staticmethod
    def cat(sources: list[tuple[str, tuple[int, ...]]]) -> WeightSpec:
        """A joined projection: the parts stacked along the output dim, in order."""
        return WeightSpec(sources, lambda ts: torch.cat(ts, dim=0))

    @staticmethod
    def same(name: str, shape: tuple[int, ...]) -> WeightSpec:
        return WeightSpec([(name, shape)], lambda ts: ts[0])
