"""Backboard: an LLM inference and serving engine for hybrid Qwen models."""

__version__ = "0.1.0"

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
