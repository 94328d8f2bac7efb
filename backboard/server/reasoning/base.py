"""Splitting a reasoning block (`<think> ... </think>`) off the output, streaming and not.

Where the output starts is decided from the prompt: a chat template may open the block itself
(Qwen3.5's with thinking on: the prompt ends in `<think>`), close it empty (thinking off), or leave
it to the model (Qwen3's: the output may start with `<think>`). The same prompt rule sets the
grammar's gate in the engine (StructuredOutputsParams.think_token_ids / think_open), so a
structured-output grammar applies exactly to what this parser calls content.

Whitespace the templates put around the markers is dropped: the reasoning has none at its ends and
the content none at its start. A block the output never closes (max_tokens) is all reasoning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from backboard.server.text_markers import split_safe

IN_REASONING, MAY_OPEN, IN_CONTENT = "reasoning", "may_open", "content"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """A think-tag reasoning format: its markers and how a prompt leaves the output's start."""

    name = ""
    start = "<think>"
    end = "</think>"

    def __init__(self, tokenizer) -> None:
        vocab = tokenizer.hf.get_vocab() if hasattr(tokenizer, "hf") else tokenizer.get_vocab()
        self.start_id, self.end_id = vocab.get(self.start), vocab.get(self.end)

    @property
    def think_token_ids(self) -> tuple[int, int] | None:
        """(start, end) ids when both markers are single tokens (the engine's grammar gate needs
        them); None otherwise (a grammar then applies from the first token)."""
        if self.start_id is None or self.end_id is None:
            return None
        return self.start_id, self.end_id

    def initial_state(self, prompt_ids: Sequence[int], thinking: bool = True) -> str:
        """Where the output starts: inside the block when the prompt's last marker opens it,
        in content when the prompt closed it or thinking is off, else a leading <think> opens it."""
        for t in reversed(prompt_ids):
            if t == self.start_id:
                return IN_REASONING
            if t == self.end_id:
                return IN_CONTENT
        return MAY_OPEN if thinking else IN_CONTENT

    def stream(self, state: str) -> "ReasoningStream":
        return ReasoningStream(self.start, self.end, state)

    def split(self, text: str, state: str) -> ReasoningDelta:
        """A whole output at once."""
        s = self.stream(state)
        a, b = s.feed(text), s.finish()
        return ReasoningDelta(a.reasoning + b.reasoning, a.content + b.content)


class ReasoningStream:
    """One output's text, fed in pieces; every piece of text comes out once, as reasoning or
    content (markers and the whitespace next to them dropped)."""

    def __init__(self, start: str, end: str, state: str) -> None:
        self.start, self.end, self.state = start, end, state
        self.buf = ""
        self.at_block_start = state == IN_REASONING    # strip whitespace after <think>
        self.at_content_start = True                   # strip whitespace after </think>
        self.saw_block = state == IN_REASONING

    def feed(self, text: str) -> ReasoningDelta:
        self.buf += text
        out = ReasoningDelta()
        while True:
            before = (self.state, len(self.buf))
            if self.state == MAY_OPEN:
                self._may_open()
            elif self.state == IN_REASONING:
                out.reasoning += self._reasoning()
            else:
                out.content += self._content()
            if (self.state, len(self.buf)) == before:
                return out

    def finish(self) -> ReasoningDelta:
        """The text held back at the end (a partial marker is plain text after all)."""
        rest, self.buf = self.buf, ""
        if self.state == IN_REASONING:
            return ReasoningDelta(reasoning=rest.rstrip() if not self.at_block_start else rest.strip())
        if self.state == MAY_OPEN or self.at_content_start:
            rest = rest.lstrip() if self.saw_block else rest
        return ReasoningDelta(content=rest)

    # ---- states -------------------------------------------------------------------------
    def _may_open(self) -> None:
        head = self.buf.lstrip()
        if head.startswith(self.start):
            self.buf = head[len(self.start):]
            self.state, self.at_block_start, self.saw_block = IN_REASONING, True, True
        elif not self.start.startswith(head):      # not a <think> after all: content
            self.state = IN_CONTENT
        # else: whitespace or part of <think>: wait

    def _reasoning(self) -> str:
        if self.at_block_start:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return ""
            self.at_block_start = False
        i = self.buf.find(self.end)
        if i >= 0:
            text, self.buf = self.buf[:i].rstrip(), self.buf[i + len(self.end):]
            self.state, self.at_content_start = IN_CONTENT, True
            return text
        safe, wait = split_safe(self.buf, (self.end,))
        kept = safe.rstrip()                          # trailing whitespace may precede </think>
        self.buf = safe[len(kept):] + wait
        return kept

    def _content(self) -> str:
        if self.at_content_start and self.saw_block:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return ""
        self.at_content_start = False
        text, self.buf = self.buf, ""
        return text
