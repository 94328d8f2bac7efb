"""The dense decoders, Qwen3, Qwen2 and Llama: the same decoder as models/qwen3_5.py with every
layer plain attention, plain RMSNorm (x_hat * w), full rotary and no attention output gate; q/k
norm (Qwen3) and biases (Qwen2's q/k/v, Llama's attention_bias) as the config says. config.py sets
those flags from the checkpoint's config, so the class adds nothing but its name."""

from __future__ import annotations

from backboard.models.qwen3_5 import Qwen3_5ForCausalLM


class Qwen3ForCausalLM(Qwen3_5ForCausalLM):
    pass
