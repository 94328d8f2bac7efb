"""Incremental detokenization with stop strings.

Multi-byte UTF-8 split across tokens is never emitted half-way (tokenizers' DecodeStream holds
partial sequences); stop strings spanning token boundaries are caught because the matcher's state carries over
between tokens (engine/stop_strings.py: each new character costs the same whatever the number of
stop strings); while streaming, the last len(longest stop) - 1 characters are held back so
that text which may turn into a stop string is never emitted. The pieces returned concatenate to
exactly the final text (the full decode, cut at a stop string when one matched)."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from backboard.engine.stop_strings import StopMatcher
from backboard.engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""            # decoded so far (may run past a stop string until cut)
        self.emitted = 0          # characters of self.text handed out
        self.stopped_by: str | None = None

    def update(self, new_token_ids: list[int]) -> str:
        """Feed new tokens; returns the newly releasable text. After a stop string matched,
        `stopped_by` is set and the text is final."""
        if self.stopped_by is not None:
            return ""
        for t in new_token_ids:
            self.token_ids.append(t)
            piece = self._stream.step(self.tok.backend, t)
            if piece:
                offset = len(self.text)
                self.text += piece
                if self._matcher is not None and self._cut_at_stop(piece, offset):
                    return self._release(len(self.text))   # later tokens are not fed
        return self._release(len(self.text) - self._hold)

    def finish(self) -> str:
        """The request ended (length, eos, abort): release everything, including bytes the stream
        still held (the tail of the full decode)."""
        if self.stopped_by is None:
            full = self.tok.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
            if full.startswith(self.text):
                self.text = full
        return self._release(len(self.text))

    def _cut_at_stop(self, piece: str, offset: int) -> bool:
        """Match the new piece; on a stop string, cut the text there (True)."""
        hit = self._matcher.feed(piece, offset)
        if hit is None:
            return False
        i, s = hit
        self.stopped_by = s
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return True

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out
