"""Ready-made sweep definitions."""

from __future__ import annotations

import os

from backboard.bench.sweep import SweepConfig, SweepError, build_config, read_definition

PRESETS_DIR = os.path.dirname(os.path.abspath(__file__))
CPU_PRESET = os.path.join(PRESETS_DIR, "cpu_vs_vllm.yaml")


def default_vllm_venv() -> str:
    from backboard.models.tiny import default_cache_dir

    return os.environ.get("VLLM_VENV") or os.path.join(default_cache_dir(), "venv-vllm-cpu")


# vLLM's CPU Gated DeltaNet kernel runs only in bf16 ("CPU GDN attention requires BF16") and
# downcasts a float32 checkpoint: with a bf16 checkpoint both engines hold the same weight values
# (Backboard computes in the preset's {backboard_dtype}, float32 by default).
CPU_PRESET_DTYPE = "bfloat16"


def prepare_cpu_preset(vllm_venv: str | None = None, model_dir: str | None = None,
                       runs: int | None = None, prompts_per_concurrency: int | None = None,
                       only: list[str] | None = None,
                       variables: dict[str, str] | None = None) -> SweepConfig:
    """The CPU preset ready to run: the demo checkpoint built if missing, vLLM's venv checked."""
    from backboard.models.tiny import build_tiny_checkpoint, default_cache_dir

    vllm_venv = os.path.abspath(os.path.expanduser(vllm_venv or default_vllm_venv()))
    model_dir = model_dir or os.path.join(default_cache_dir(), "models",
                                          f"qwen3_5_text-demo-{CPU_PRESET_DTYPE}")
    model_dir = os.path.abspath(os.path.expanduser(model_dir))
    definition = read_definition(CPU_PRESET)
    names = [t["name"] for t in definition["targets"]]
    wants_vllm = "vllm" in (only or names)
    launcher = os.path.join(vllm_venv, "bin", "vllm-cpu-serve")
    if wants_vllm and not os.path.isfile(os.path.join(vllm_venv, ".backboard-ready")):
        raise SweepError(f"vLLM's CPU build is not set up in {vllm_venv} (no {launcher}): run "
                         "benchmarks/setup_vllm_cpu.sh (or pass --only backboard)")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        print(f"[preset] building the demo checkpoint ({CPU_PRESET_DTYPE}) in {model_dir}",
              flush=True)
        build_tiny_checkpoint(model_dir, arch="qwen3_5_text", preset="demo",
                              dtype=CPU_PRESET_DTYPE)
    v = {"model": model_dir, "vllm_venv": vllm_venv}
    v.update(variables or {})
    overrides = {"runs": runs, "prompts_per_concurrency": prompts_per_concurrency}
    if prompts_per_concurrency is not None:  # warmups as InferenceX: 2 per 10 prompts, at least 1
        overrides["warmups_per_concurrency"] = max(1, prompts_per_concurrency // 5)
    return build_config(definition, overrides=overrides, variables=v, only=only)
