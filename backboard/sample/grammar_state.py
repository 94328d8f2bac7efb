"""One request's grammar state: an xgrammar matcher behind the reasoning gate.

The gate keeps the grammar off while the model reasons (vLLM's and SGLang's structured output
constrain the reasoning block too, or break on it):

    REASONING   inside <think>...</think>: every token allowed; </think> turns the grammar on
    START       no block seen yet: the grammar's first tokens, or <think> (which opens the block)
    ACTIVE      the grammar constrains every token

Tokens can be accepted tentatively (draft checking) and rolled back: each accepted token logs the
gate before it and whether the matcher took it."""

from __future__ import annotations

import logging
from collections import deque
from typing import Sequence

import numpy as np

from backboard.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

REASONING, START, ACTIVE = 0, 1, 2
MAX_ROLLBACK = 64          # tentative tokens a state can take back (drafts + the bonus token)


class RequestGrammar:
    def __init__(self, compiled, so: StructuredOutputsParams) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled, )
        self.think_start, self.think_end = so.think_token_ids or (-1, -1)
        self.gate = ACTIVE if so.think_token_ids is None else (REASONING if so.think_open else START)
        self._log: deque[tuple[int, bool]] = deque(maxlen=MAX_ROLLBACK)
        self.num_rejected = 0           # committed tokens the grammar refused (should stay 0)

    # ---- tokens ---------------------------------------------------------------------------
    def accept(self, token: int) -> bool:
        """Advance past `token`; False (state unchanged) when the grammar forbids it."""
        gate, fed = self.gate, False
        if gate == REASONING:
            if token == self.think_end:
                self.gate = ACTIVE
        elif gate == START and token == self.think_start:
            self.gate = REASONING
        else:
            if not self.matcher.accept_token(token):
                return False
            fed, self.gate = True, ACTIVE
        self._log.append((gate, fed))
        return True

    def accept_committed(self, tokens: Sequence[int]) -> None:
        """Tokens the request really emitted (the mask allowed them; a refusal is logged)."""
        for t in tokens:
            if not self.accept(int(t)):
                self.num_rejected += 1
                if self.num_rejected == 1:
                    logger.warning("a sampled token (%d) is outside its request's grammar", t)

    def rollback(self, n: int) -> None:
        """Take back the last n accepted tokens."""
        fed = 0
        for _ in range(n):
            gate, took = self._log.pop()
            fed += took
            self.gate = gate
        if fed:
            self.matcher.rollback(fed)

    def legal_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar allows (the state is left as it was)."""
        n = 0
        for t in tokens:
            if not self.accept(int(t)):
                break
            n += 1
        self.rollback(n)
        return n

    # ---- masks ----------------------------------------------------------------------------
    def fill(self, bitmask, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row] ([R, W] int32, CPU); True when the row
        forbids something (it must be applied)."""
        if self.gate == REASONING:
            bitmask[row].fill_(-1)
            return False
        if self.matcher.is_terminated():       # past its stop token (ignore_eos): only stop tokens
            bitmask[row].fill_(0)
            for t in self.matcher.stop_token_ids:
                _set_bit(bitmask, row, t)
            return True
        need = self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.gate == START and self.think_start >= 0:
            _set_bit(bitmask, row, self.think_start)
        return bool(need)

    @property
    def is_terminated(self) -> bool:
        return self.gate == ACTIVE and self.matcher.is_terminated()


def _set_bit(bitmask, row: int, token: int) -> None:
    w = bitmask[row, token >> 5]
    bitmask[row, token >> 5] = int(np.int32(np.uint32((int(w) & 0xFFFFFFFF) | (1 << (token & 31)))))
