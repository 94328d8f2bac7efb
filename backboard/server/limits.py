"""What one client may ask of the front end: the server's limits, their flags, and the checks.

Every request's work in the HTTP process is bounded before it is done:

    body         Content-Length over the limit: 413 before a byte of the body is read (a chunked
                 body is counted as it arrives); a body not complete within body_timeout: 408.
                 A client that goes away mid-upload is one INFO line, not an error.
    prompt       characters counted before tokenizing (a cheap bound on the tokenizer's work),
                 then tokens against the context (engine/output_processor.py).
    stop         at most max_stop_strings strings of at most max_stop_string_chars characters; the
                 matcher's cost per token does not grow with their number (engine/stop_strings.py).
    n            at most max_n completions; n x max_tokens (max_tokens unset: the context left
                 after the prompt) at most max_request_output_tokens.
    logprobs     top-20 at most; a non-streamed response at most max_logprob_entries entries
                 (n x max_tokens x (1 + logprobs), plus prompt tokens x (1 + prompt_logprobs)):
                 stream to get more, since a stream never holds a whole response in memory.
    streams      each request's undelivered output is bounded (stream_buffer_tokens per
                 completion): past it the request is paused in the engine until the client reads;
                 a connection that takes nothing for send_timeout is closed (its request aborted,
                 its KV blocks and state slots freed).
    connections  headers must be complete within header_timeout of the connection opening (or
                 of a new request starting on it): idle and slow-loris connections are closed;
                 between requests, keep_alive_timeout.
    store        /v1/responses kept for previous_response_id: at most max_stored_responses
                 responses and max_stored_response_chars characters in all (an LRU).

The settings are fields of ServerLimits, defined once: `backboard serve` builds its flags from
them (add_limit_args) the way engine/cli.py does for EngineArgs."""

from __future__ import annotations

import argparse
import asyncio
import logging
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any

from backboard.sampling_params import SamplingParams
from backboard.server.errors import bad_request, error_body

logger = logging.getLogger("backboard.server")

MIB = 2 ** 20


def _limit(default: Any, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerLimits:
    """The front end's per-request and per-connection limits (None: derived, see resolve())."""

    max_request_body_bytes: int | None = _limit(
        None, "request bodies larger than this get 413 before they are read "
              "(default: 6 x max-prompt-chars + 1 MiB: room for a prompt of escaped JSON)")
    max_prompt_chars: int | None = _limit(
        None, "prompt characters (all chat messages together), checked before tokenizing "
              "(default: 16 x max-model-len)")
    max_stop_strings: int = _limit(32, "stop strings per request (OpenAI allows 4)")
    max_stop_string_chars: int = _limit(256, "characters per stop string")
    max_n: int = _limit(128, "completions per request (n)")
    max_request_output_tokens: int | None = _limit(
        None, "n x max_tokens per request; an unset max_tokens counts as the context left after the "
              "prompt (default: 8 x max-model-len)")
    max_logprob_entries: int = _limit(
        262_144, "logprob entries in a non-streamed response: n x max_tokens x (1 + logprobs), plus "
                 "prompt tokens x (1 + prompt_logprobs); streamed responses are not limited")
    stream_buffer_tokens: int = _limit(
        256, "tokens per completion produced but not yet taken by a slow client; past this the "
             "request is paused in the engine until the client reads")
    send_timeout: float = _limit(
        60.0, "seconds: close a connection that takes none of its response for this many seconds "
              "(its request is aborted and its KV blocks and state slots freed)")
    header_timeout: float = _limit(
        20.0, "seconds: close a connection whose request headers are not complete this many seconds after "
              "it opened or its request began (idle and slow-loris connections)")
    body_timeout: float = _limit(60.0, "seconds: a request body must arrive within this time (else 408)")
    keep_alive_timeout: float = _limit(30.0, "seconds: close a keep-alive connection idle this long between requests")
    max_stored_responses: int = _limit(
        1024, "/v1/responses kept in memory for previous_response_id and GET /v1/responses/{id} "
              "(least recently used dropped first)")
    max_stored_response_chars: int = _limit(
        32 * MIB, "characters of conversation all stored /v1/responses hold together (least recently "
                  "used dropped first)")

    def resolve(self, max_model_len: int) -> "ServerLimits":
        """The derived defaults filled in; raises ValueError on a nonsensical setting."""
        prompt_chars = self.max_prompt_chars or 16 * max_model_len
        out = replace(self, max_prompt_chars=prompt_chars,
                      max_request_body_bytes=self.max_request_body_bytes or 6 * prompt_chars + MIB,
                      max_request_output_tokens=self.max_request_output_tokens or 8 * max_model_len)
        for f in fields(out):
            if getattr(out, f.name) <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be > 0; got {getattr(out, f.name)}")
        return out


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """One flag per ServerLimits field (--max-stop-strings for max_stop_strings)."""
    group = p.add_argument_group("limits (per request and per connection)")
    hints = typing.get_type_hints(ServerLimits)
    for f in fields(ServerLimits):
        kind = float if float in typing.get_args(hints[f.name]) or hints[f.name] is float else int
        help_ = f.metadata["help"] + (f" (default: {f.default:g})" if f.default is not None else "")
        group.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=help_)


def limit_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in fields(ServerLimits)}


# ---- request checks ---------------------------------------------------------------------------
def check_params(limits: ServerLimits, params: SamplingParams) -> None:
    """What can be checked before the prompt is tokenized: n and the stop strings."""
    if params.n > limits.max_n:
        raise bad_request(f"n must be an integer in [1, {limits.max_n}], got {params.n}", "n")
    if len(params.stop) > limits.max_stop_strings:
        raise bad_request(f"at most {limits.max_stop_strings} stop strings are allowed; got {len(params.stop)}",
                          "stop")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise bad_request(f"stop strings may have at most {limits.max_stop_string_chars} characters; "
                          f"got one of {longest}", "stop")


def check_prompt_chars(limits: ServerLimits, num_chars: int, param: str) -> None:
    if num_chars > limits.max_prompt_chars:
        raise bad_request(f"the prompt has {num_chars} characters; this server takes at most "
                          f"{limits.max_prompt_chars} (--max-prompt-chars)", param)


def check_output(limits: ServerLimits, params: SamplingParams, num_prompt_tokens: int, max_model_len: int,
                 stream: bool) -> None:
    """n x max_tokens, and a non-streamed response's logprob entries (after tokenizing)."""
    per = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt_tokens
    total = params.n * per
    if total > limits.max_request_output_tokens:
        what = "max_tokens" if params.max_tokens is not None else "the context left after the prompt"
        raise bad_request(f"n x max_tokens is {params.n} x {per} = {total} tokens ({what}); this server "
                          f"allows at most {limits.max_request_output_tokens} per request; lower n or max_tokens",
                          "max_tokens" if params.max_tokens is not None else "n")
    if stream:
        return
    entries = total * (1 + params.logprobs) if params.logprobs is not None else 0
    if params.prompt_logprobs is not None:
        entries += num_prompt_tokens * (1 + params.prompt_logprobs)
    if entries > limits.max_logprob_entries:
        raise bad_request(f"this non-streamed response would carry {entries} logprob entries (n x max_tokens x "
                          f"(1 + logprobs)); at most {limits.max_logprob_entries} are allowed: lower them or "
                          "stream the response", "logprobs")


# ---- the body ---------------------------------------------------------------------------------
class BodyGuard:
    """Pure ASGI middleware: reads a request's body before the app runs, within the size limit
    and the body timeout, then replays it (so every route sees a bounded, complete body)."""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.limits.max_request_body_bytes:
            return await _reject(send, 413, self._too_large(declared))
        try:
            body = await asyncio.wait_for(self._read(receive), self.limits.body_timeout)
        except _TooLarge as e:
            return await _reject(send, 413, self._too_large(e.size))
        except _Gone as e:
            logger.info("%s %s: the client went away during its upload (%d of %s bytes)", scope["method"],
                        scope.get("path"), e.size, declared if declared is not None else "?")
            return None
        except asyncio.TimeoutError:
            return await _reject(send, 408, f"the request body did not arrive within {self.limits.body_timeout:g} s")
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self, size: int) -> str:
        return (f"the request body ({size} bytes) exceeds this server's limit of "
                f"{self.limits.max_request_body_bytes} bytes (--max-request-body-bytes)")

    async def _read(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Gone(size)
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_request_body_bytes:
                raise _TooLarge(size)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


class _Gone(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive):
    """A receive() that hands out the body once, then waits on the real one (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reject(send, status: int, message: str) -> None:
    """An OpenAI-style error that also closes the connection (the rest of the body is not read)."""
    from backboard.server.responses import dumps

    payload = dumps(error_body(message, "invalid_request_error")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})

