"""Shared fixtures: tiny checkpoints built once per test session (and cached on disk across
sessions under the pytest cache, keyed by the builder's source so a change rebuilds them)."""

from __future__ import annotations

import hashlib
import inspect
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _builder_hash() -> str:
    from backboard.models import tiny

    return hashlib.sha1(inspect.getsource(tiny).encode()).hexdigest()[:10]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, request):
    """arch -> path of a tiny checkpoint (built on first use)."""
    from backboard.models.tiny import build_tiny_checkpoint

    root = request.config.cache.mkdir(f"tiny-models-{_builder_hash()}")
    built: dict[str, str] = {}

    def get(arch: str, **kw) -> str:
        key = arch + "".join(f"-{k}={v}" for k, v in sorted(kw.items()))
        if key not in built:
            path = os.path.join(root, key)
            if not os.path.isfile(os.path.join(path, "config.json")):
                build_tiny_checkpoint(path, arch=arch, **kw)
            built[key] = path
        return built[key]

    return get


@pytest.fixture(scope="session")
def hybrid_model(tiny_models) -> str:
    """The Qwen3.5 vision-language layout hybrid (sharded, with MTP weights)."""
    return tiny_models("qwen3_5")


@pytest.fixture(scope="session")
def soft_model(tiny_models) -> str:
    """The tiny hybrid at transformers' default weight scale: the next token depends mostly on the
    current one, a structure a one-layer draft head can learn (the strong-layer tiny model is
    near-random)."""
    return tiny_models("qwen3_5", init_std=0.02)


@pytest.fixture(scope="session")
def trained_draft_head(soft_model, tmp_path_factory) -> tuple[str, dict]:
    """(folder, training stats) of a 4-bit draft head distilled from soft_model (tens of seconds;
    once per session: the speculation and tensor-parallel tests share it)."""
    from backboard.spec_decode.train import self_generated_text, train_draft_head

    out = str(tmp_path_factory.mktemp("draft"))
    text = self_generated_text(soft_model, 24, 96, seed=0)
    stats = train_draft_head(soft_model, text, out, steps=120, seq_len=96, batch_size=4, lr=1e-2,
                             max_windows=48, log=lambda *a: None)
    return out, stats


def hf_reference(path: str, dtype=None):
    """transformers' own implementation of the checkpoint (the oracle), fp32 by default."""
    import json

    import torch
    import transformers as tf

    with open(os.path.join(path, "config.json")) as f:
        mt = json.load(f)["model_type"]
    cls = tf.AutoModelForImageTextToText if mt == "qwen3_5" else tf.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=dtype or torch.float32)
    return model.eval()
