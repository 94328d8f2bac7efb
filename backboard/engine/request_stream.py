"""What the front end hands a caller per request: a RequestStream of deltas, its timings, and
the errors a request can end with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from backboard.core.outputs import TokenLogprobs


class EngineDeadError(RuntimeError):
    """The engine process is gone; in-flight requests fail with this."""


class EngineStartError(RuntimeError):
    """The engine process could not load the model (the message says why)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RequestRejected(ValueError):
    """The engine core refused the request (e.g. it can never fit in the KV cache)."""


@dataclass
class ChildDelta:
    """What one step added to one completion (child) of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestTimings:
    """Timestamps (time.time()) along the path of one request."""

    arrival: float                        # the request reached the app (ASGI start, before its body)
    sent: float = 0.0                     # queued for the engine (written at the end of the loop turn)
    engine_received: float | None = None  # the engine process took it off the pipe
    first_scheduled: float | None = None  # engine clock
    engine_first_token: float | None = None  # engine clock: first token sampled
    first_output: float | None = None     # the front end processed the first token
    finished: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return dict(self.__dict__)


class RequestStream:
    """One request's deltas, queued for its HTTP handler. `get()` returns every delta pending
    (a slow reader gets several at once; nothing is merged or lost)."""

    def __init__(self, request_id: str, parent, timings: RequestTimings) -> None:
        self.request_id, self.parent, self.timings = request_id, parent, timings
        self.finished = False
        self.aborted = False
        self._pending: list[ChildDelta] = []
        self._event = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.parent.prompt_ids)

    def _put(self, deltas: list[ChildDelta], finished: bool) -> None:
        self._pending.extend(deltas)
        self.finished = self.finished or finished
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    async def get(self) -> list[ChildDelta]:
        """Wait for deltas; [] once the request is finished and everything was taken."""
        while not self._pending and self._error is None and not self.finished:
            self._event.clear()
            await self._event.wait()
        if self._pending:
            out, self._pending = self._pending, []
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
