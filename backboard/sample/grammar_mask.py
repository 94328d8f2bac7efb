"""The grammar side of a step: which logit rows the grammars constrain, filled into one token
bitmask for all of them, and the grammar states advanced on the tokens the step emits.

Speculation stays lossless with a grammar: a request verifying k drafts has 1 + k logit rows, and
row j is masked by the grammar's state after drafts 0..j-1 (accepted tentatively, then rolled back).
A draft the grammar forbids is masked out of its own row, so the verifier rejects it there and
draws from the masked distribution instead: the accepted run is cut at the longest legal prefix.
Drafts are also cut to their legal prefix when proposed (no verify rows spent on them).

Shapes: B requests in batch order, R logit rows, W = ceil(V / 32) bitmask words."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from backboard.sample.grammar_state import RequestGrammar
from backboard.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarBatch:
    """The grammar state of each live constrained request, by request id."""

    def __init__(self, compiled_grammar) -> None:
        self.compiled_grammar = compiled_grammar      # StructuredOutputsParams -> CompiledGrammar
        self.states: dict[str, RequestGrammar] = {}

    def add(self, req_id: str, so: StructuredOutputsParams, output_token_ids: Sequence[int]) -> None:
        """A request (again, after preemption: its outputs so far are replayed)."""
        g = RequestGrammar(self.compiled_grammar(so), so)
        g.accept_committed(output_token_ids)
        self.states[req_id] = g

    def remove(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def of(self, req_ids: Sequence[str]) -> list[RequestGrammar | None] | None:
        """[B] the states of these requests (None for unconstrained ones); None when none is."""
        if not self.states:
            return None
        got = [self.states.get(r) for r in req_ids]
        return got if any(g is not None for g in got) else None


def fill_step_bitmask(grammars: Sequence[RequestGrammar | None], drafts: Sequence[Sequence[int]],
                      logit_start: np.ndarray, num_logits: np.ndarray, vocab_size: int,
                      ) -> tuple[torch.Tensor, list[int]]:
    """The bitmask of every logit row ([R, W] int32 on the CPU; unconstrained rows all ones) and
    the rows that forbid something. grammars, drafts, logit_start, num_logits: [B] each."""
    R = int(num_logits.sum())
    bitmask = torch.full((R, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    rows: list[int] = []
    for i, g in enumerate(grammars):
        if g is None or num_logits[i] == 0:
            continue
        s, d = int(logit_start[i]), drafts[i]
        taken = 0
        for j in range(len(d) + 1):
            if g.fill(bitmask, s + j):
                rows.append(s + j)
            if j == len(d) or not g.accept(int(d[j])):
                break                   # later rows are never used: draft j is rejected at row j
            taken += 1
            if g.is_terminated:
                break                   # a stop token ends the request: later rows are never used
        g.rollback(taken)
    return bitmask, rows


def accept_step_tokens(grammars: Sequence[RequestGrammar | None], tokens: Sequence[Sequence[int]]) -> None:
    """Advance each constrained request past the tokens it emitted this step ([B] each)."""
    for g, toks in zip(grammars, tokens):
        if g is not None and toks:
            g.accept_committed(toks)


def cut_drafts(grammars: Sequence[RequestGrammar | None], drafts: list[list[int]]) -> list[list[int]]:
    """Each constrained request's drafts cut to the longest prefix its grammar allows ([B])."""
    return [d if g is None or not d else d[:g.legal_prefix(d)] for g, d in zip(grammars, drafts)]
