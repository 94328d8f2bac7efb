#!/usr/bin/env bash
# The old name of benchmarks/cpu_scorecard.sh (which now adds llama.cpp's server as a third engine).
exec "$(dirname "$0")/cpu_scorecard.sh" "$@"
