"""Backboard: an LLM inference and serving engine for hybrid Qwen models."""

import os

__version__ = "0.1.0"

# OpenMP threads that wait for work spin briefly, then sleep, unless the user chose otherwise. It
# must be set before torch loads its OpenMP runtime, so it lives here. On these 2-core machines the
# engine shares its cores with the front end and the client: GOMP's default spin (300,000 rounds)
# held a core its partner needed, and every parallel region then waited a whole time slice
# (tiny hybrid, machine at load 4-5, 16 requests x 100 tokens: 3.4-4.8 s spinning vs 0.46 s
# passive). Fully passive threads pay a futex wake-up in each of a decode step's ~60 parallel
# regions instead: one request's TPOT through the server, CPU benchmark checkpoint, 21.8-22.7 ms
# passive, 17.3-18.8 with 50,000 rounds (about 0.1 ms), 17.4 always spinning.
SPIN_ROUNDS = "50000"
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_ROUNDS)

# Tensors of 2 MiB and more (weights, KV cache, state slots, large activations) on transparent
# huge pages: torch's CPU allocator aligns them to 2 MiB and asks madvise(MADV_HUGEPAGE) when this
# is set before its first allocation, so, like the line above, it lives here. A decode step
# streams every weight once: on 4 KiB pages that is a TLB miss every 4 KiB (80,000 for the CPU
# benchmark checkpoint's 330 MB per step). Where the kernel's THP setting is "never" it is advice
# that changes nothing; THP_MEM_ALLOC_ENABLE=0 turns it off.
THP_ENV = "THP_MEM_ALLOC_ENABLE"
os.environ.setdefault(THP_ENV, "1")

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
