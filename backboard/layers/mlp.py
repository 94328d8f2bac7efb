"""SwiGLU MLP (gate/up joined) and the Qwen3-Next mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backboard.layers.linear import Linear
from backboard.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from backboard.ops import dispatch


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up joined into one GEMM. Under TP gate / up are
    column-parallel (each rank a share of both parts) and down row-parallel; parallel=False keeps
    it whole on every rank (the MoE's shared expert)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, parallel: bool = True) -> None:
        super().__init__()
        self.inter = inter
        if parallel:
            self.gate_up_proj: Linear = ColumnParallelLinear(hidden, [inter, inter], dtype)
            self.down_proj: Linear = RowParallelLinear(inter, hidden, dtype)
        else:
            self.gate_up_proj, self.down_proj = Linear(hidden, [inter, inter], dtype), Linear(inter, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(dispatch.silu_mul(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """fp32 softmax router, top-k (renormalised when norm_topk_prob), experts, plus a shared
    expert scaled by sigmoid(shared_expert_gate(x)).

    Expert weights are stacked: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]. Under TP
    the whole block is replicated on every rank (not split)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int,
                 norm_topk_prob: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.inter, self.norm_topk_prob = num_experts, top_k, inter, norm_topk_prob
        self.gate = Linear(hidden, num_experts, dtype)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False)
        self.shared_expert = MLP(hidden, shared_inter, dtype, parallel=False)
        self.shared_expert_gate = Linear(hidden, 1, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)       # [T, E]
        topv, topi = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topv = topv / topv.sum(-1, keepdim=True)
        topv = topv.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(topi).tolist():
            tok, slot = torch.where(topi == e)
            gu = dispatch.linear(x[tok], self.w13[e])
            h = F.silu(gu[:, :self.inter]) * gu[:, self.inter:]
            y = dispatch.linear(h, self.w2[e]) * topv[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared
