"""HF model_type -> model class."""

from __future__ import annotations

from backboard.config import DENSE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig


def model_class(cfg: ModelConfig):
    from backboard.models.qwen3 import Qwen3ForCausalLM
    from backboard.models.qwen3_5 import Qwen3_5ForCausalLM

    table = {
        "qwen3_5": Qwen3_5ForCausalLM,
        "qwen3_5_text": Qwen3_5ForCausalLM,
        "qwen3_next": Qwen3_5ForCausalLM,
        **dict.fromkeys(DENSE_ARCHITECTURES, Qwen3ForCausalLM),     # one config-driven dense class
    }
    if cfg.model_type not in table:
        raise ConfigError(f"unsupported architecture {cfg.model_type!r}; supported: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return table[cfg.model_type]
