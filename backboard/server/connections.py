"""uvicorn's HTTP/1.1 protocol (httptools) with the two timeouts it lacks.

    header timeout   a connection must complete its request headers within header_timeout of
                     opening, or of its next request's first byte: an idle connection that never
                     sends a request, and a slow-loris one that sends its headers a byte at a
                     time, are closed (uvicorn only times out keep-alive gaps after a response).
    send timeout     a connection whose socket has not taken any of its response for
                     send_timeout (the transport's write buffer is over its high-water mark the
                     whole time) is dropped: its request sees a disconnect and is aborted, which
                     frees its KV blocks and state slots. The engine side stops producing for it
                     long before (a bounded RequestStream pauses the request).

Both close quietly (one INFO line for a send timeout: a request was cut short) and are counted
(`on_timeout("header" | "send")`: backboard:http_connections_timed_out_total)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("backboard.server")


def guarded_protocol(header_timeout: float, send_timeout: float,
                     on_timeout: Callable[[str], None] | None = None) -> type:
    """The protocol class for uvicorn.Config(http=...), with these timeouts."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"header_timeout": header_timeout, "send_timeout": send_timeout,
                 "on_timeout": staticmethod(on_timeout or (lambda reason: None))})


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout = 20.0
    send_timeout = 60.0
    on_timeout: Callable[[str], None] = staticmethod(lambda reason: None)

    _header_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._header_timer = _cancel(self._header_timer)
        super().on_headers_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._on_send_timeout)

    def resume_writing(self) -> None:
        self._send_timer = _cancel(self._send_timer)
        super().resume_writing()

    def connection_lost(self, exc) -> None:
        self._header_timer = _cancel(self._header_timer)
        self._send_timer = _cancel(self._send_timer)
        super().connection_lost(exc)

    # ---------------------------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.on_timeout("header")
            self.transport.close()

    def _on_send_timeout(self) -> None:
        self._send_timer = None
        self.on_timeout("send")
        client = "%s:%d" % self.client if self.client else "a client"
        logger.info("%s took none of its response for %.0f s: connection dropped, its request aborted",
                    client, self.send_timeout)
        self.transport.abort()       # close() would wait for the unread buffer to drain


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()
    return None
