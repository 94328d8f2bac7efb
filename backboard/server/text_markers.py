"""Finding markers (`</think>`, `<tool_call>`, ...) in text that arrives in pieces: what is safe to
hand on now, and what must wait because it may be the start of a marker cut by a chunk boundary."""

from __future__ import annotations


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of the markers."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """(position, marker) of the earliest marker in text[start:]; (-1, None) when none."""
    pos, found = -1, None
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (pos < 0 or i < pos):
            pos, found = i, m
    return pos, found


def split_safe(text: str, markers: tuple[str, ...]) -> tuple[str, str]:
    """(what can be emitted now, what must wait for more text): the wait part is a possible marker
    start at the end."""
    n = partial_suffix(text, markers)
    return (text[:len(text) - n], text[len(text) - n:]) if n else (text, "")
