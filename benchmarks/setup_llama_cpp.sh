#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` from the llama.cpp that PyPI's `llama-cpp-python` sdist
# vendors, as a peer for `backboard bench` on CPU machines. Idempotent and cached: a finished build
# is left as it is.
#
#   benchmarks/setup_llama_cpp.sh     # -> $LLAMA_CPP_DIR (default ~/.cache/backboard/llama.cpp-0.3.36)
#
# Afterwards $LLAMA_CPP_DIR holds
#   bin/llama-server               the native server (continuous batching, honours ignore_eos)
#   src/convert_hf_to_gguf.py      the vendored converter; run it with PYTHONPATH=src/gguf-py
#   src/gguf-py/                   (and `requirements` for it: numpy, sentencepiece, transformers...)
# Why not llama-cpp-python's own server: it handles one request at a time and ignores ignore_eos.
# Why from PyPI: the machines here reach package registries only; the sdist pins one llama.cpp that
# runs Qwen3.5 hybrids (GGUF arch `qwen35`).
# The build takes about 12 minutes on 2 idle cores (longer on a busy machine); it runs under
# `nice -n ${LLAMA_CPP_NICE:-10}`. Environment: LLAMA_CPP_DIR, LLAMA_CPP_PYTHON_VERSION (0.3.36),
# LLAMA_CPP_JOBS (default: all cores), PYTHON (for pip download; default python3).
# GGML_NATIVE=ON builds for this machine's CPU: copy the cache only to machines with the same ISA.
set -euo pipefail

CACHE="${BACKBOARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/backboard}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${LLAMA_CPP_DIR:-$CACHE/llama.cpp-$VERSION}"
PY="${PYTHON:-python3}"
JOBS="${LLAMA_CPP_JOBS:-$(nproc)}"
NICE="${LLAMA_CPP_NICE:-10}"
MARK="$VERSION native-1 $(grep -o -m1 -E 'avx512_bf16|avx512f|avx2' /proc/cpuinfo || echo generic)"

if [[ -f "$DIR/.backboard-ready" && "$(cat "$DIR/.backboard-ready")" == "$MARK" \
      && -x "$DIR/bin/llama-server" ]]; then
  echo "llama-server (llama-cpp-python $VERSION) is ready in $DIR"
  exit 0
fi
mkdir -p "$DIR"

# 1. the sdist, from PyPI, and its vendored llama.cpp
if [[ ! -f "$DIR/src/convert_hf_to_gguf.py" ]]; then
  echo "downloading the llama-cpp-python $VERSION sdist (about 50 MB)"
  tmp="$(mktemp -d "$DIR/.download.XXXXXX")"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: --dest "$tmp" \
    "llama-cpp-python==$VERSION"
  tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  rm -rf "$DIR/src"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src"
  rm -rf "$tmp"
fi

# 2. the native server only (the flags of /work/shared/reference/cpu-peers.md)
echo "building llama-server in $DIR/build ($JOBS jobs, nice $NICE; about 12 min on 2 idle cores)"
nice -n "$NICE" cmake -S "$DIR/src" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_CUDA=OFF \
  -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
nice -n "$NICE" cmake --build "$DIR/build" -j "$JOBS" --target llama-server
mkdir -p "$DIR/bin"
cp "$DIR/build/bin/llama-server" "$DIR/bin/llama-server"
"$DIR/bin/llama-server" --version 2>&1 | head -3
echo "$MARK" > "$DIR/.backboard-ready"
echo "llama-server ready: $DIR/bin/llama-server; converter: PYTHONPATH=$DIR/src/gguf-py" \
     "python $DIR/src/convert_hf_to_gguf.py CHECKPOINT --outtype bf16 --outfile X.gguf"
