"""Reasoning parsers (`--reasoning-parser NAME`): split the model's reasoning block off its output
into `reasoning_content`."""

from __future__ import annotations

from backboard.server.reasoning.base import (
    IN_CONTENT,
    IN_REASONING,
    MAY_OPEN,
    ReasoningDelta,
    ReasoningParser,
    ReasoningStream,
)
from backboard.server.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "qwen3_5": Qwen3ReasoningParser,
}


def reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser named `name` for this tokenizer; ValueError names the known ones."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")
    return cls(tokenizer)


__all__ = ["IN_CONTENT", "IN_REASONING", "MAY_OPEN", "REASONING_PARSERS", "ReasoningDelta", "ReasoningParser",
           "ReasoningStream", "reasoning_parser"]
