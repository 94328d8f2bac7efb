"""The scheduler and the cache allocators: pure Python, no tensors, no torch.cuda, no triton."""
