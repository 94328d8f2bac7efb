"""What the engine process runs with, for the dashboard: configuration and build (device, dtype,
kernels in use, threads, cache sizes). Gathered once, in the engine process, when it is ready."""

from __future__ import annotations

import platform
from typing import Any

import torch


def engine_info(core) -> dict[str, Any]:
    """JSON-able facts about a started EngineCore (engine/engine_core.py)."""
    from backboard import __version__

    cfg, runner = core.cfg, core.runner
    mc, sc = cfg.model, cfg.scheduler
    return {
        "backboard": __version__, "torch": str(torch.__version__), "python": platform.python_version(),
        "model": mc.path, "model_type": mc.model_type, "dtype": mc.dtype,
        "device": cfg.device, "device_name": device_name(cfg.device),
        "threads": torch.get_num_threads() if not cfg.device.startswith("cuda") else None,
        "kernels": kernels_in_use(cfg.device),
        "cuda_graphs": getattr(runner, "graphs", None) is not None,
        "block_size": cfg.cache.block_size, "num_kv_blocks": runner.num_blocks,
        "num_state_slots": runner.num_slots if mc.is_hybrid else None,
        "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_model_len": sc.max_model_len, "scheduling_policy": sc.policy,
        "speculative": ({"method": cfg.spec.method, "num_speculative_tokens": cfg.num_spec_tokens,
                         "adaptive": cfg.spec.adaptive} if cfg.spec is not None else None),
        "prefix_caching": cfg.cache.enable_prefix_caching,
        "tensor_parallel_size": cfg.parallel.tensor_parallel_size,
        "distributed_executor_backend": cfg.parallel.distributed_executor_backend,
    }


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    from backboard.ops.cpu.build import cpu_model

    return cpu_model()


def kernels_in_use(device: str) -> str:
    """Which kernel family the layers dispatch to on this device (ops/dispatch.py, ops/cpu/)."""
    from backboard.ops import dispatch

    mode = dispatch.kernel_mode()
    if device.startswith("cuda"):
        triton = mode != "torch" and dispatch.triton_available()
        return f"{'Triton' if triton else 'torch references'} (BACKBOARD_KERNELS={mode})"
    from backboard.ops.cpu.build import cpu_isa, kernels_enabled

    cpp = f"C++ {cpu_isa()} where built" if kernels_enabled() else "C++ kernels off"
    return f"torch references, {cpp}"
