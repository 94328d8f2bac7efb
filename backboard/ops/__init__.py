"""Pure tensor functions, no engine imports. Each op has a torch reference (the CPU path and the
test oracle) and, where it pays, a Triton kernel beside it.

Naming: `x_ref` is the torch reference of op x, written for clarity, that x's kernels are tested
against (ops/dispatch.py picks a kernel or `x_ref`); `x` alone is the one implementation there is
(e.g. write_kv, gdn_chunked_varlen)."""
