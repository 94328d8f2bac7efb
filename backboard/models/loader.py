"""Checkpoint loading: safetensors (single file or sharded), memory-mapped; key remapping; joined
projections built at load time; every mismatch stops loading with a message naming the tensor.

Key normalisation: `model.language_model.*` -> `model.*` (Qwen3.5 vision-language layout),
`model.visual.*` dropped (text serving), `mtp.*` kept for the MTP head (the target model ignores
them; models/mtp.py loads them)."""

from __future__ import annotations

import glob
import json
import os
from typing import Callable, Iterable

import torch
from torch import nn

from backboard.models.registry import model_class
from backboard.models.weight_arena import pack_weights
from backboard.models.weights import TensorSlice, WeightSpec


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded; the message names the tensor and what was expected."""


_DROP_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


def normalize_key(key: str) -> str | None:
    """Checkpoint key -> the engine's key space, or None when the key is not for text serving."""
    if key.startswith(_DROP_PREFIXES):
        return None
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key.startswith("language_model.model."):
        return "model." + key[len("language_model.model."):]
    if key.startswith("language_model.lm_head."):
        return key[len("language_model."):]
    return key


class Checkpoint:
    """The safetensors tensors of a checkpoint folder, opened lazily (memory-mapped)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._files: dict[str, object] = {}
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            missing_files = sorted({fn for fn in weight_map.values()
                                    if not os.path.isfile(os.path.join(path, fn))})
            if missing_files:
                raise CheckpointError(f"{index} lists shard files that are missing: {missing_files}")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {path} (only safetensors checkpoints "
                                      "are supported)")
            weight_map = {}
            for fn in files:
                for k in self._handle(fn).keys():
                    weight_map[k] = fn
        self.key_file: dict[str, str] = {}
        self.raw_name: dict[str, str] = {}
        for raw, fn in weight_map.items():
            k = normalize_key(raw)
            if k is None:
                continue
            if k in self.key_file:
                raise CheckpointError(f"tensor {k} appears twice in {path} ({raw!r} and "
                                      f"{self.raw_name[k]!r})")
            self.key_file[k], self.raw_name[k] = fn, raw

    def _handle(self, fn: str):
        from safetensors import safe_open

        if fn not in self._files:
            try:
                self._files[fn] = safe_open(os.path.join(self.path, fn), framework="pt")
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"cannot read {os.path.join(self.path, fn)}: {e}") from e
        return self._files[fn]

    def __contains__(self, key: str) -> bool:
        return key in self.key_file

    def keys(self) -> Iterable[str]:
        return self.key_file.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        f = self._handle(self.key_file[key])
        return tuple(f.get_slice(self.raw_name[key]).get_shape())

    def get(self, key: str, part: TensorSlice | None = None) -> torch.Tensor:
        """The tensor, or only the rows / columns of `part` (read from the file, nothing else)."""
        f = self._handle(self.key_file[key])
        if part is None:
            return f.get_tensor(self.raw_name[key])
        sl = f.get_slice(self.raw_name[key])
        pieces = [sl[a:b] if part.dim == 0 else sl[:, a:b] for a, b in part.ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=part.dim)


def load_weights(module: nn.Module, ckpt: Checkpoint, specs: dict[str, WeightSpec],
                 checkpoint_name: Callable[[str], str], is_ignored: Callable[[str], bool],
                 owned: Callable[[str], bool] = lambda k: True) -> None:
    """Fill every parameter of `module` from `ckpt`.

    specs: parameters built from other tensors (joined, reshaped); every other parameter maps one
    to one to `checkpoint_name(param)`. `owned(k)` says which checkpoint keys this module is
    responsible for; of those, any not consumed and not `is_ignored` is an unexpected tensor."""
    consumed: set[str] = set()
    for pname, param in module.named_parameters():
        spec = specs.get(pname) or _direct_spec(checkpoint_name(pname), param)
        parts = []
        for i, (src, shape) in enumerate(spec.sources):
            if src not in ckpt:
                raise CheckpointError(f"missing tensor {src} (the model expects shape {list(shape)}) "
                                      f"in checkpoint {ckpt.path}")
            actual = ckpt.shape(src)
            if tuple(actual) != tuple(shape):
                raise CheckpointError(f"shape mismatch for tensor {src}: checkpoint has {list(actual)}, "
                                      f"the model expects {list(shape)} (does config.json match the "
                                      "weights?)")
            parts.append(ckpt.get(src, spec.slice_of(i)))
            consumed.add(src)
        value = spec.combine(parts)
        if tuple(value.shape) != tuple(param.shape):  # a bug in a spec, not in the checkpoint
            raise CheckpointError(f"internal: {pname} built with shape {list(value.shape)}, "
                                  f"parameter has {list(param.shape)}")
        with torch.no_grad():
            param.copy_(value)
    unexpected = sorted(k for k in ckpt.keys() if owned(k) and k not in consumed and not is_ignored(k))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(f"unexpected tensor(s) in checkpoint {ckpt.path}: "
                              f"{', '.join(unexpected[:5])}{more}; shape {list(ckpt.shape(unexpected[0]))} "
                              "for the first. Does config.json match the weights?")


def _direct_spec(name: str, param: torch.Tensor) -> WeightSpec:
    """A parameter read one to one: whole, or its rank's slice (a parallel layer's ParamShard)."""
    shard = getattr(param, "shard", None)
    return WeightSpec.same(name, tuple(param.shape)) if shard is None else WeightSpec.sharded(name, shard)


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(cfg, device: str = "cpu") -> nn.Module:
    """Build the model class registered for cfg and load its weights from cfg.path."""
    cls = model_class(cfg)
    dtype = torch_dtype(cfg.dtype)
    ckpt = Checkpoint(cfg.path)
    with torch.device(device):
        model = cls(cfg, dtype)
    load_weights(model, ckpt, model.weight_specs(), model.checkpoint_name,
                 model.ignored_checkpoint_keys())
    if torch.device(device).type == "cpu":
        pack_weights(model)                 # one buffer in forward order (models/weight_arena.py)
    model.eval()
    return model
