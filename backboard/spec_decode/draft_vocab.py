"""The draft vocabulary and the LM head that drafts over it.

A draft only has to name the token the target will choose; the target checks every draft over the
whole vocabulary, so drafting over fewer tokens stays lossless and only costs the drafts whose
token lies outside them (FR-Spec: frequency-ranked drafting). The draft head's LM head is most of
a draft's bytes (SmolLM2: 49152 x 576 in int8, 28 MB, read once per draft, from memory for the
first draft of a step), so its vocabulary is the training answers' most frequent tokens, enough
of them to cover `cover` of those answers' tokens (SmolLM2: 15360 of 49152).

What a fixed vocabulary misses is the request's own words: on held-out chat topics, 2.2% of the
answer tokens fell outside SmolLM2's, nearly all of them the topic's words from the prompt
(" magnets", " octopus", " Giza"). So each request's context tokens outside the vocabulary
(ContextTokens) are drafted over too, from the target's LM head rows (with one rank: under TP a
rank holds only its share of those rows, and the draft vocabulary drafts over its own tokens)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from backboard.ops import dispatch
from backboard.spec_decode.proposer import running_only

DEFAULT_COVER = 0.999      # share of the training answer tokens the draft vocabulary covers
MULTIPLE = 1024            # the size is rounded up to this (and capped at the vocabulary)


def choose_draft_vocab(tokens: np.ndarray, vocab_size: int, size: int | None = None,
                       cover: float = DEFAULT_COVER) -> np.ndarray:
    """The draft vocabulary from the tokens the drafts should name (tokens [N], e.g. a chat
    corpus's answer tokens): the `size` most frequent (ties: lower ids first), or the fewest
    covering `cover` of `tokens`, rounded up to a multiple of MULTIPLE. -> sorted ids [V'] int64."""
    counts = np.bincount(tokens.astype(np.int64), minlength=vocab_size)[:vocab_size]
    ranked = np.argsort(-counts, kind="stable")
    if size is None:
        covered = np.cumsum(counts[ranked]) / max(int(counts.sum()), 1)
        need = int(np.searchsorted(covered, cover)) + 1
        size = -(-need // MULTIPLE) * MULTIPLE
    return np.sort(ranked[:min(size, vocab_size)]).astype(np.int64)


def parse_draft_vocab(spec: "str | int") -> "str | int":
    """`--draft-vocab`: "auto" (the fewest tokens covering DEFAULT_COVER), "full" (the whole
    vocabulary) or a number of tokens."""
    if spec in ("auto", "full"):
        return spec
    if not str(spec).isdigit() or int(spec) < 1:
        raise ValueError(f"--draft-vocab must be auto, full or a positive number of tokens, not {spec!r}")
    return int(spec)


def draft_vocab_for(tokens: np.ndarray, vocab_size: int, spec: "str | int") -> np.ndarray | None:
    """The draft vocabulary `spec` (parse_draft_vocab) asks for, from the tokens drafts should
    name; None for the whole vocabulary (asked for, or what the choice came to)."""
    spec = parse_draft_vocab(spec)
    if spec == "full":
        return None
    ids = choose_draft_vocab(tokens, vocab_size, None if spec == "auto" else spec)
    return ids if len(ids) < vocab_size else None


def coverage(vocab: np.ndarray, tokens: np.ndarray) -> float:
    """Share of tokens [N] inside the draft vocabulary."""
    return float(np.isin(tokens, vocab).mean()) if len(tokens) else 1.0


MAX_EXTRA = 1024    # context tokens outside the vocabulary drafted over per step, at most


class ContextTokens:
    """Per request, the tokens of its context (prompt and output so far) outside the draft
    vocabulary, kept up to date incrementally (each call scans only the tokens new since the
    last)."""

    def __init__(self, vocab: torch.Tensor, vocab_size: int) -> None:
        self.outside = np.ones(vocab_size, dtype=bool)
        self.outside[vocab.cpu().numpy()] = False
        self.seen: dict[str, tuple[int, np.ndarray]] = {}       # req_id -> (tokens scanned, ids outside)

    def of(self, rid: str, tokens: np.ndarray) -> np.ndarray:
        """tokens [n]: the request's known tokens -> its sorted ids outside the vocabulary."""
        n0, have = self.seen.get(rid, (0, np.zeros(0, np.int64)))
        if n0 > len(tokens):                                   # shorter than before: recomputed
            n0, have = 0, np.zeros(0, np.int64)
        new = tokens[n0:]
        new = new[self.outside[new]]
        if len(new):
            have = np.union1d(have, new)
        self.seen[rid] = (len(tokens), have)
        return have

    def union(self, rids: list[str], tokens: list[np.ndarray]) -> np.ndarray:
        """The requests' ids outside the vocabulary, together (at most MAX_EXTRA) [E]."""
        out = np.unique(np.concatenate([self.of(r, t) for r, t in zip(rids, tokens)] + [np.zeros(0, np.int64)]))
        return out[:MAX_EXTRA]

    def keep_only(self, rids: list[str]) -> None:
        """Forget requests that are not running (finished, aborted, preempted)."""
        self.seen = running_only(self.seen, rids)


class DraftLMHead:
    """Greedy drafts from the head's hidden states: hidden [R, H] -> token ids [R] (int64).

    `small` gives fp32 logits [R, V'] over the draft vocabulary (token_ids [V'], or the whole
    vocabulary when None); `large`, when given, takes batches of more than rows_max rows (a bf16
    target's bf16 LM head rows where the INT8 kernel is slower: dispatch.int8_lm_head_rows_max)."""

    def __init__(self, small: Callable[[torch.Tensor], torch.Tensor],
                 large: Callable[[torch.Tensor], torch.Tensor] | None = None, rows_max: int | None = None,
                 token_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> None:
        """rows [V, H]: the target's LM head (whole), the source of the extra tokens' logits
        (None: no extra tokens)."""
        self.small, self.large, self.rows_max, self.token_ids = small, large, rows_max, token_ids
        self.rows = rows

    @property
    def size(self) -> int | None:
        """Tokens it drafts over (None: the whole vocabulary)."""
        return None if self.token_ids is None else len(self.token_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> fp32 logits [R, V'] (the draft vocabulary's columns)."""
        big = self.large is not None and self.rows_max is not None and h.shape[0] > self.rows_max
        return self.large(h) if big else self.small(h)

    def extra(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Extra tokens to draft over ([E] ids outside the vocabulary) for the steps' calls:
        -> (every id drafted over [V' + E], the extra tokens' LM head rows [E, H]), or None."""
        if self.rows is None or self.token_ids is None or not len(ids):
            return None
        t = torch.from_numpy(ids).to(self.rows.device)
        return torch.cat([self.token_ids, t]), self.rows[t]

    def __call__(self, h: torch.Tensor, extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        logits = self.logits(h)
        if extra is not None:
            logits = torch.cat([logits, dispatch.linear(h, extra[1], out_dtype=torch.float32)], 1)
        best = dispatch.argmax(logits)
        ids = self.token_ids if extra is None else extra[0]
        return best if ids is None else ids[best]
