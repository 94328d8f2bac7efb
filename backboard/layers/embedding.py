"""Token embedding and the LM head (only the rows asked for)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backboard.ops import dispatch


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """logits [R, V] in fp32 for hidden rows [R, H]. Tied to the embedding when `tied` is given."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tied: VocabEmbedding | None = None) -> None:
        super().__init__()
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(h, self.weight, out_dtype=torch.float32)
