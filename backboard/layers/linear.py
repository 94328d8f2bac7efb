"""Linear layers. Weights are [out_features, in_features] in the model dtype; joined projections
(q/k/v, gate/up, the four GDN inputs) are one weight whose rows are the parts, in order. Every
forward goes through ops/dispatch.py (bf16 / int8 / int4 weights on the CPU: our C++ kernels)."""

from __future__ import annotations

import torch
from torch import nn

from backboard.ops import dispatch


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int | list[int], dtype: torch.dtype,
                 bias: bool = False) -> None:
        super().__init__()
        self.output_sizes = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        out = sum(self.output_sizes)
        self.in_features, self.out_features = in_features, out
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Split a joined output into its parts (views)."""
        return list(torch.split(y, self.output_sizes, dim=-1))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}"


def bf16_linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """The model's bf16 Linear weights [out, in] (the CPU GEMM packs them for oneDNN and warms its
    kernels on their shapes)."""
    return [m.weight for m in model.modules() if isinstance(m, Linear) and m.weight.dtype == torch.bfloat16]


class Int4Linear(nn.Module):
    """Weight-only int4 (group-quantized along K, symmetric) with fp32 accumulation: the draft
    head's layers. Buffers: qweight uint8 [out, in // 2] (two nibbles per byte), scales
    [out, in // group_size]; format in ops/quant.py."""

    def __init__(self, in_features: int, out_features: int | list[int], group_size: int,
                 scale_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.output_sizes = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        out = sum(self.output_sizes)
        self.in_features, self.out_features, self.group_size = in_features, out, group_size
        self.register_buffer("qweight", torch.zeros(out, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(out, in_features // group_size, dtype=scale_dtype))

    @classmethod
    def from_linear(cls, lin: Linear, group_size: int) -> "Int4Linear":
        from backboard.ops.quant import quantize_int4

        m = cls(lin.in_features, lin.output_sizes, group_size)
        m.qweight, m.scales = quantize_int4(lin.weight.detach(), group_size)
        return m

    def widened(self, dtype: torch.dtype) -> Linear:
        """The same layer as a Linear with the dequantized weight in dtype (the int4 values times
        their scales, rounded once to dtype)."""
        from backboard.ops.quant import dequantize_int4

        lin = Linear(self.in_features, self.output_sizes, dtype)
        lin.weight.data = dequantize_int4(self.qweight, self.scales, self.group_size, dtype)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = dispatch.int4_linear(x.reshape(-1, shape[-1]), self.qweight, self.scales, self.group_size)
        return y.reshape(*shape[:-1], self.out_features)

    split = Linear.split


class Int8Linear(nn.Module):
    """Weight-only int8 with per-output-channel scales and fp32 accumulation (the draft LM head).
    Returns fp32 (logits)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(out_features, dtype=torch.float32))

    @classmethod
    def from_weight(cls, w: torch.Tensor) -> "Int8Linear":
        from backboard.ops.quant import quantize_int8

        m = cls(w.shape[1], w.shape[0])
        m.qweight, m.scales = quantize_int8(w.detach())
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # activations in the model dtype (exact), fp32 accumulation and logits
        return dispatch.int8_linear(x, self.qweight, self.scales, torch.float32)
