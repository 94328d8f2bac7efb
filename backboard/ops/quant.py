"""Weight-only int8 / int4 quantization: formats, quantizers and torch matmul references.

These are the CPU path (the draft head of speculative decoding proposes on the CPU too) and the
oracle of the Triton kernels in ops/triton/quant_gemm.py. Weights are [N, K] = [out, in], as in
`F.linear`; activations x are [M, K]; outputs [M, N] in x's dtype, accumulated in fp32.

int8, per output channel (symmetric):
    q      int8 [N, K]    q = clamp(round(w / scale[n]), -127, 127)
    scale  fp32 [N]       scale[n] = max_k |w[n, k]| / 127   (0 for an all-zero row)
    w ~= q * scale[:, None]

int4, grouped along K (symmetric, group size G even and dividing K, e.g. 32 / 64 / 128):
    scales [N, K // G]    scales[n, g] = max |w[n, gG:(g+1)G]| / 7 (fp32, or fp16 / bf16 to
                          save memory; the quantizer rounds with the stored scale)
    q                     clamp(round(w / scales[n, k // G]), -8, 7), stored offset by 8 as an
                          unsigned nibble u = q + 8 in [0, 15]
    packed uint8 [N, K // 2]   byte j of row n holds element 2j in its low nibble and element
                          2j + 1 in its high nibble: packed = u[:, 0::2] | (u[:, 1::2] << 4)
    w ~= (u - 8) * scales[n, k // G]

The references dequantize a slab of rows at a time to fp32 and matmul, so a large matrix (an
LM head) never needs a full fp32 copy.
"""

from __future__ import annotations

import torch

_SLAB_ELEMS = 1 << 24          # dequantize at most this many weights at a time (64 MiB in fp32)


def _slab_rows(K: int) -> int:
    return max(1, _SLAB_ELEMS // max(1, K))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (q int8 [N, K], scale fp32 [N])."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_int8: w must be a 2-D float tensor, got {w.dtype} {tuple(w.shape)}")
    wf = w.float()
    scale = wf.abs().amax(dim=1) / 127.0                              # [N]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wf / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> w [N, K] in dtype."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ (q * scale)^T. x: [M, K] float; q: int8 [N, K]; scale: [N]. Returns [M, N] in
    out_dtype (default x's dtype; fp32 accumulation)."""
    _check_linear("int8_linear_ref", x, q, q.shape[1])
    if q.dtype != torch.int8 or scale.shape != (q.shape[0],):
        raise ValueError(f"int8_linear_ref: q must be int8 [N, K] and scale [N]; got {q.dtype} "
                         f"{tuple(q.shape)}, scale {tuple(scale.shape)}")
    N, K = q.shape
    xf = x.float()
    y = torch.empty(x.shape[0], N, dtype=out_dtype or x.dtype, device=x.device)
    rows = _slab_rows(K)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        y[:, n0:n1] = (xf @ q[n0:n1].float().t() * scale[n0:n1].float()).to(y.dtype)
    return y


def quantize_int4(w: torch.Tensor, group_size: int = 128,
                  scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (packed uint8 [N, K // 2], scales [N, K // group_size] in scale_dtype)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_int4: w must be a 2-D float tensor, got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    _check_group(K, group_size, "quantize_int4")
    wg = w.float().reshape(N, K // group_size, group_size)
    scales = (wg.abs().amax(dim=-1) / 7.0).to(scale_dtype)               # [N, G]
    s = scales.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(wg / safe[..., None]).clamp_(-8, 7).to(torch.int16) + 8
    u = q.reshape(N, K).to(torch.uint8)
    packed = u[:, 0::2] | (u[:, 1::2] << 4)
    return packed.contiguous(), scales


def fake_quant_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] float -> the fp32 values quantize_int4 + dequantize_int4 give (fp32 scales), with
    the gradient passed straight through to w (quantization-aware training of the draft head)."""
    wf = w.float()
    wq = dequantize_int4(*quantize_int4(wf.detach(), group_size), group_size)
    return wf + (wq - wf).detach()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [N, K // 2], scales [N, K // group_size] -> w [N, K] in dtype."""
    N, half = packed.shape
    K = 2 * half
    _check_group(K, group_size, "dequantize_int4")
    q = torch.empty(N, K, dtype=torch.float32, device=packed.device)
    q[:, 0::2] = (packed & 0xF).float()
    q[:, 1::2] = (packed >> 4).float()
    q -= 8.0
    w = q.view(N, K // group_size, group_size) * scales.float()[..., None]
    return w.view(N, K).to(dtype)


def int4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """y = x @ dequantize_int4(packed, scales)^T. x: [M, K] float; packed: uint8 [N, K // 2];
    scales: [N, K // group_size]. Returns [M, N] in x's dtype (fp32 accumulation)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"int4_linear_ref: packed must be uint8 [N, K // 2], got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    N, K = packed.shape[0], 2 * packed.shape[1]
    _check_linear("int4_linear_ref", x, packed, K)
    _check_group(K, group_size, "int4_linear_ref")
    if scales.shape != (N, K // group_size):
        raise ValueError(f"int4_linear_ref: scales must be [{N}, {K // group_size}], got {tuple(scales.shape)}")
    xf = x.float()
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    rows = _slab_rows(K)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        w = dequantize_int4(packed[n0:n1], scales[n0:n1], group_size)
        y[:, n0:n1] = (xf @ w.t()).to(x.dtype)
    return y


def _check_linear(op: str, x: torch.Tensor, w: torch.Tensor, K: int) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{op}: x must be a 2-D float tensor [M, K], got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != K:
        raise ValueError(f"{op}: x has K={x.shape[1]} but the weight has K={K}")
    if w.dim() != 2:
        raise ValueError(f"{op}: the weight must be 2-D, got {tuple(w.shape)}")


def _check_group(K: int, group_size: int, op: str) -> None:
    if group_size <= 0 or group_size % 2 or K % group_size:
        raise ValueError(f"{op}: group_size must be even and divide K={K}; got {group_size}")
