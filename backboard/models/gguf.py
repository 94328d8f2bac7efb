"""GGUF checkpoints (llama.cpp's format) served as Hugging Face folders.

A GGUF file carries the config, the tokenizer and chat template, and the tensors (often
quantized) in one file. Backboard converts it once into a Hugging Face folder: transformers'
GGUF reader (which uses the `gguf` package) maps the names and the metadata and dequantizes every
tensor to float32, exactly the values transformers itself computes with when it loads the file
with `gguf_file=`; the folder (config.json, model.safetensors, tokenizer files) is what the loader,
transformers and vLLM read. The engine then casts to the serving dtype as for any checkpoint.

    resolve_model_path("x.gguf")   -> the converted folder, cached under the Backboard cache by
                                      the file's name, size and modification time (a folder is
                                      returned unchanged)
    convert_gguf("x.gguf", OUT)    -> OUT (`backboard convert`)

Architectures: llama (Llama 2/3, SmolLM2, ...), qwen2, qwen3. Tensor types: F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K ... Q6_K. Anything else stops with a message
that names it."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

from backboard.config import ConfigError

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")     # GGUF general.architecture (= the model_type)
SERVING_DTYPE = "bfloat16"                    # what "auto" serves a converted folder in
FORMAT = "2"                                  # of the cached folders: bump when conversion changes
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def _reader(path: str):
    try:
        from gguf import GGUFReader
    except ImportError as e:                         # a dependency; only a broken install lacks it
        raise ConfigError("reading a GGUF file needs the `gguf` package: pip install gguf") from e
    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise ConfigError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field_str(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def check_gguf(path: str) -> str:
    """The file's architecture, after checking it and every tensor type are supported."""
    if not os.path.isfile(path):
        raise ConfigError(f"GGUF file {path!r} does not exist")
    reader = _reader(path)
    arch = _field_str(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                          f"{', '.join(ARCHITECTURES)}")
    for t in reader.tensors:
        if t.tensor_type.name not in TENSOR_TYPES:
            raise ConfigError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which is not "
                              f"supported; supported: {', '.join(TENSOR_TYPES)}")
    return arch


def convert_gguf(path: str, out_dir: str) -> str:
    """Write the Hugging Face folder of a GGUF file into out_dir (float32 weights, served in bf16
    by default); returns it."""
    check_gguf(path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gguf-", dir=parent)
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        _forget_gguf_quantization(model)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _serve_in(tmp, SERVING_DTYPE)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except Exception as e:  # noqa: BLE001 - a conversion failure stops start-up with one line
        raise ConfigError(f"could not convert {path} ({type(e).__name__}: {e})") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _forget_gguf_quantization(model) -> None:
    """transformers marks a model loaded from GGUF as quantized (and refuses to save it), although
    its weights are already dequantized fp32: the saved folder is a plain checkpoint."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _serve_in(folder: str, dtype: str) -> None:
    """The folder's config names the dtype to serve in ("auto" picks it): the weights stay fp32 (the
    exact dequantized values, what parity tests load) but a quantized GGUF is served in bf16, as
    llama.cpp computes it, not at twice the bytes per step."""
    import json

    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def cached_folder(path: str, cache_dir: str) -> str:
    """Where the conversion of this file (by name, size and modification time) is cached."""
    st = os.stat(path)
    key = hashlib.sha256(f"{FORMAT}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    stem = os.path.basename(path)[:-len(".gguf")]
    return os.path.join(cache_dir, "gguf", f"{stem}-{key[:12]}")


def resolve_model_path(model: str, cache_dir: str | None = None) -> str:
    """A GGUF file -> its converted folder (converted on first use); anything else unchanged."""
    if not is_gguf(model):
        return model
    if not os.path.isfile(model):
        raise ConfigError(f"GGUF file {model!r} does not exist")
    from backboard.models.tiny import default_cache_dir

    out = cached_folder(model, cache_dir or default_cache_dir())
    if not os.path.isfile(os.path.join(out, "config.json")):
        logger.info("converting %s to a Hugging Face folder in %s (once)", model, out)
        convert_gguf(model, out)
    return out
