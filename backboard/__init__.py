"""Backboard: an LLM inference and serving engine for hybrid Qwen models."""

import os

__version__ = "0.1.0"

# OpenMP threads that wait for work sleep instead of spinning, unless the user chose otherwise. It
# must be set before torch loads its OpenMP runtime, so it lives here. On these 2-core machines the
# engine shares its cores with the front end and the client: a spinning thread holds a core its
# partner needs, and every parallel region then waits a whole time slice. Measured on the tiny
# hybrid with the machine at load 4-5, 16 requests x 100 tokens: 3.4-4.8 s spinning (the
# default) vs 0.46 s passive, 0.33-0.53 s with one thread (the spread is the noise).
if "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # lazy, so that `import backboard` (e.g. for the CLI) does not import torch
    if name == "LLM":
        from backboard.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from backboard.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'backboard' has no attribute {name!r}")
