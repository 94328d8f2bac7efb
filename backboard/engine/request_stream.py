"""What the front end hands a caller per request: a RequestStream of deltas, its timings, and
the errors a request can end with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from backboard.core.outputs import TokenLogprobs


class EngineDeadError(RuntimeError):
    """The engine process is gone; in-flight requests fail with this."""


class EngineStartError(RuntimeError):
    """The engine process could not load the model (the message says why)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ServerShuttingDown(EngineDeadError):
    """The server is stopping (drain timeout, second signal): the request is cut short."""


class RequestRejected(ValueError):
    """The engine core refused the request (e.g. it can never fit in the KV cache)."""


Logprobs = dict[int, float]     # token id -> logprob (the prompt token's and the top-n)


@dataclass
class CompletionDelta:
    """What one engine step added to one completion (one of the request's n)."""

    index: int
    text: str                                   # new text (detokenized; stop strings applied)
    token_ids: list[int]                        # new token ids
    logprobs: list[TokenLogprobs] | None        # one per new token, when the request asked for them
    finish_reason: str | None                   # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None               # the stop string or stop token that ended it


@dataclass
class RequestDelta:
    """One engine step's result for one request: everything the server needs to answer, and no
    engine state. The deltas of a request, concatenated per completion, are its whole output."""

    request_id: str
    outputs: list[CompletionDelta]              # the completions this step advanced
    finished: bool                              # every completion has finished
    num_prompt_tokens: int
    num_output_tokens: int                      # over all completions, up to this step (usage)
    prompt_logprobs: list[Logprobs | None] | None = None  # the whole prompt's (first entry None),
    #                                             on the finishing delta, when the request asked
    num_cached_tokens: int = 0                  # prompt tokens the prefix cache served (usage)


@dataclass
class RequestTimings:
    """Timestamps (time.time()) along the path of one request."""

    arrival: float                        # the request reached the app (ASGI start, before its body)
    sent: float = 0.0                     # queued for the engine (written at the end of the loop turn)
    engine_received: float | None = None  # the engine process took it off its socket
    first_scheduled: float | None = None  # engine clock
    engine_first_token: float | None = None  # engine clock: first token sampled
    first_output: float | None = None     # the front end processed the first token
    finished: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return dict(self.__dict__)


class RequestStream:
    """One request's deltas, queued for its reader (an HTTP handler). `get()` returns every delta
    pending: a slow reader gets several at once; nothing is merged or lost. Also the request's
    timings and, once it ends, how each completion finished (for metrics).

    Bounded: once more than `max_pending_tokens` tokens wait for the reader, `on_pressure(True)`
    is called (the engine client pauses the request in the engine: it stops producing), and
    `on_pressure(False)` once the reader has taken them."""

    def __init__(self, request_id: str, n: int, num_prompt_tokens: int, timings: RequestTimings,
                 max_pending_tokens: int | None = None,
                 on_pressure: Callable[[bool], None] | None = None) -> None:
        self.request_id, self.n, self.timings = request_id, n, timings
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = [0] * n                  # per completion, so far
        self.num_cached_tokens = 0                        # prompt tokens served by the prefix cache
        self.finish_reasons: list[str | None] = [None] * n
        self.finished = False
        self.aborted = False
        self._pending: list[RequestDelta] = []
        self._pending_tokens = 0
        self.max_pending_tokens, self.on_pressure = max_pending_tokens, on_pressure
        self.paused = False
        self._event = asyncio.Event()
        self._error: BaseException | None = None

    # ---- the engine client's side --------------------------------------------------------
    def push(self, delta: RequestDelta) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        for c in delta.outputs:
            self.num_output_tokens[c.index] += len(c.token_ids)
            self._pending_tokens += len(c.token_ids)
            self.finish_reasons[c.index] = c.finish_reason
        self._pending.append(delta)
        self.finished = self.finished or delta.finished
        self._event.set()
        if (self.max_pending_tokens is not None and not self.paused and not self.finished
                and self._pending_tokens > self.max_pending_tokens):
            self._set_paused(True)

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused
        if self.on_pressure is not None:
            self.on_pressure(paused)

    @property
    def num_pending_tokens(self) -> int:
        return self._pending_tokens

    def abort(self) -> None:
        """Ended by the caller: completions still running finish as "abort"."""
        self.aborted = True
        self.finish_reasons = [r or "abort" for r in self.finish_reasons]

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    # ---- the reader's side ---------------------------------------------------------------
    async def get(self) -> list[RequestDelta]:
        """Wait for deltas; [] once the request is finished and everything was taken."""
        while not self._pending and self._error is None and not self.finished:
            self._event.clear()
            await self._event.wait()
        if self._pending:
            out, self._pending, self._pending_tokens = self._pending, [], 0
            if self.paused:
                self._set_paused(False)
            return out
        if self._error is not None:
            raise self._error
        return []

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        while True:
            deltas = await self.get()
            if not deltas:
                return
            yield deltas
