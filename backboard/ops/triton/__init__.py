"""Triton kernels for the GPU decode hot path, one module per kernel family.

Importing this package does not import triton; each kernel module does (at import time, so
`TRITON_INTERPRET=1` must be set before a module is imported to run its kernels on CPU tensors).
Layers never import these modules directly: `backboard.ops.dispatch` chooses, per call, between a
kernel here and its torch reference.

    gdn_decode   GDN decode / verify step: conv-state update + conv + SiLU, then gating, q/k L2
                 norm, GQA delta rule over slotted fp32 states and the gated output norm
    attention    paged decode attention (multi-row for draft rows), split-K over the context
    norm         RMSNorm, fused residual add + RMSNorm, gated RMSNorm (the GDN output norm)
    activation   SiLU-mul (SwiGLU)
    quant_gemm   int8 (per-channel) and int4 (grouped) weight-only matmul, small M

Every kernel `_x_kernel` has a checked launcher `x(...)` that raises ValueError on bad shapes,
dtypes, strides or devices, and is tested against its torch reference in tests/ops/.
"""
