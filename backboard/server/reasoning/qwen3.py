"""Qwen3 / Qwen3.5 / Qwen3.6 reasoning: `<think> ... </think>` (single tokens in their vocabularies).

Qwen3's chat template leaves the block to the model (the output starts with `<think>`); Qwen3.5's
opens it in the prompt (`<think>\\n`) or, with enable_thinking false, closes it empty; both are the
base class's prompt rule."""

from __future__ import annotations

from backboard.server.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    start = "<think>"
    end = "</think>"
