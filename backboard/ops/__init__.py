"""Pure tensor functions, no engine imports. Each op has a torch reference (the CPU path and the
test oracle) and, where it pays, a Triton kernel beside it."""
