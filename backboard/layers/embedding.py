"""Token embedding and the LM head (only the rows asked for), vocabulary-parallel under TP: each
rank holds rows [start, end) of the vocabulary (distributed/shard.VocabShard, padded to equal
shards). The embedding sums the ranks' lookups (each id is found on exactly one rank, zeros
elsewhere: exact); the LM head gathers the ranks' logit columns. TP = 1: the plain ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backboard.distributed.parallel_state import all_gather_last, all_reduce, tp_rank, tp_size
from backboard.distributed.shard import TensorSlice, VocabShard, set_shard
from backboard.ops import dispatch


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard = s = VocabShard.of(vocab_size, tp_size(), tp_rank())
        self.weight = nn.Parameter(torch.empty(s.padded, hidden_size, dtype=dtype), requires_grad=False)
        if tp_size() > 1:
            set_shard(self.weight, (vocab_size, hidden_size), TensorSlice.rows((s.start, s.end)),
                      s.padded - (s.end - s.start))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, H]."""
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.shard.start) | (ids >= self.shard.end)
        e = F.embedding(torch.where(outside, 0, ids - self.shard.start), self.weight)
        return all_reduce(e.masked_fill_(outside[:, None], 0))     # no boolean indexing: no host sync


class ParallelLMHead(nn.Module):
    """logits [R, V] in fp32 for hidden rows [R, H]. Tied to the embedding when `tied` is given
    (the same vocabulary shard)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        if tied is not None:
            self.weight = tied.weight
            return
        s = VocabShard.of(vocab_size, tp_size(), tp_rank())
        self.weight = nn.Parameter(torch.empty(s.padded, hidden_size, dtype=dtype), requires_grad=False)
        if tp_size() > 1:
            set_shard(self.weight, (vocab_size, hidden_size), TensorSlice.rows((s.start, s.end)),
                      s.padded - (s.end - s.start))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = dispatch.linear(h, self.weight, out_dtype=torch.float32)
        if tp_size() == 1:
            return logits
        return all_gather_last(logits)[:, :self.vocab_size]

