"""Tensor-parallel linears (vLLM's names). Under TP = 1 both are the plain `Linear`.

    ColumnParallelLinear   output rows split: each part of a joined projection (q / k / v,
                           gate / up, the GDN inputs) keeps its own range, so a rank holds whole
                           heads; no communication
    RowParallelLinear      input columns split; partial sums in fp32, one all-reduce, then the
                           bias and the model dtype (as the unsplit GEMM: fp32 accumulation, one
                           rounding)"""

from __future__ import annotations

import torch

from backboard.distributed.parallel_state import all_reduce, tp_rank, tp_size
from backboard.distributed.shard import TensorSlice, even_range, set_shard
from backboard.layers.linear import Linear
from backboard.ops import dispatch


class ColumnParallelLinear(Linear):
    """x [T, in] -> this rank's rows of each part [T, sum(local sizes)].

    output_sizes: the full parts; part_ranges: the rows [start, end) of each part this rank keeps
    (default: an equal share of each)."""

    def __init__(self, in_features: int, output_sizes: int | list[int], dtype: torch.dtype,
                 bias: bool = False, part_ranges: list[tuple[int, int]] | None = None) -> None:
        full = list(output_sizes) if isinstance(output_sizes, (list, tuple)) else [output_sizes]
        ranges = part_ranges or [even_range(n, tp_size(), tp_rank()) for n in full]
        super().__init__(in_features, [e - s for s, e in ranges], dtype, bias)
        self.full_sizes, self.part_ranges = full, ranges
        if len(full) == 1 and tp_size() > 1:           # loaded one to one: the rank's rows
            set_shard(self.weight, (full[0], in_features), TensorSlice.rows(ranges[0]))
            if self.bias is not None:
                set_shard(self.bias, (full[0],), TensorSlice.rows(ranges[0]))

    def part_slice(self, i: int, offset: int = 0) -> TensorSlice:
        """The rows of part i this rank reads from a checkpoint tensor where the part starts at
        row `offset`."""
        s, e = self.part_ranges[i]
        return TensorSlice.rows((offset + s, offset + e))


class RowParallelLinear(Linear):
    """x [T, in / tp] (this rank's columns) -> [T, out], summed over the ranks."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False) -> None:
        size = tp_size()
        super().__init__(in_features // size, out_features, dtype, bias)
        if size > 1:
            set_shard(self.weight, (out_features, in_features),
                      TensorSlice(1, (even_range(in_features, size, tp_rank()),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return super().forward(x)
        y = all_reduce(dispatch.linear(x, self.weight, out_dtype=torch.float32))
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)
