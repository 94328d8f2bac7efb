"""benchmarks/gpu_check.py by concern (plan, budget, kernel path, timing, checks, bench, engine,
report)."""
