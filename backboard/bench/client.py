"""The InferenceX request: a streaming POST and how its stream is read.

Two of InferenceX's `--backend`s: `vllm` (= `openai`: POST /v1/completions, the one its runs use)
and `openai-chat` (POST /v1/chat/completions, one user message), for servers whose completions
endpoint cannot be measured as InferenceX reads it (llama.cpp's server puts `usage` in a chunk that
still has `choices`, so every request would count 0 output tokens)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from backboard.bench.dataset import BenchRequest
from backboard.bench.metrics import RequestOutput

# the reference client allows a request up to 6 hours
REQUEST_TIMEOUT_S = 6 * 3600.0


def completion_payload(model: str, req: BenchRequest) -> dict:
    """The request body InferenceX sends (`--backend vllm --ignore-eos`)."""
    return {
        "model": model,
        "prompt": req.prompt,
        "temperature": 0.0,
        "best_of": 1,
        "max_tokens": req.output_len,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def chat_payload(model: str, req: BenchRequest) -> dict:
    """The request body of InferenceX's `--backend openai-chat --ignore-eos`."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": req.prompt}]}],
        "temperature": 0.0,
        "max_completion_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


@dataclass(frozen=True)
class Backend:
    """One InferenceX `--backend`: the endpoint, the request body and how the stream is read."""

    name: str
    path: str
    chat: bool

    def payload(self, model: str, req: BenchRequest) -> dict:
        return (chat_payload if self.chat else completion_payload)(model, req)


BACKENDS = {b.name: b for b in (Backend("vllm", "/v1/completions", chat=False),
                                Backend("openai", "/v1/completions", chat=False),
                                Backend("openai-chat", "/v1/chat/completions", chat=True))}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}") from None


class StreamReader:
    """Reads one response stream line by line into a RequestOutput.

    Each line is stripped; blank lines are skipped; the prefix `data: ` is removed; `[DONE]` is
    ignored; the rest must be JSON (a parse error raises). A chunk with non-empty `choices` is a
    token chunk (timestamps TTFT / ITL / E2EL); otherwise `usage.completion_tokens`, if present,
    sets the output token count.

    chat: as InferenceX's openai-chat reader, the text is `choices[0].delta.content` and every
    parsed chunk (the usage chunk too) moves the end of the request (E2EL)."""

    def __init__(self, out: RequestOutput, st: float, chat: bool = False) -> None:
        self.out = out
        self.st = st
        self.last = st
        self.chat = chat
        self.got_token = False
        self.text: list[str] = []

    def feed(self, line: str | bytes, now: float) -> None:
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        line = line.strip()
        if not line:
            return
        line = line.removeprefix("data: ")
        if line == "[DONE]":
            return
        data = json.loads(line)
        choices = data.get("choices")
        if choices:
            if not self.got_token:
                self.got_token = True
                self.out.ttft = now - self.st
            else:
                self.out.itl.append(now - self.last)
            self.last = now
            self.text.append(self._text(choices[0]) or "")
        elif usage := data.get("usage"):
            self.out.output_tokens = int(usage.get("completion_tokens") or 0)
            if self.chat:
                self.last = now

    def _text(self, choice: dict) -> str | None:
        return (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")

    def finish(self) -> None:
        """A request succeeds with HTTP 200 and at least one token chunk."""
        self.out.generated_text = "".join(self.text)
        self.out.latency = self.last - self.st
        if self.got_token:
            self.out.success = True
        else:
            self.out.error = "the stream ended without a token chunk (no chunk with choices)"


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, prompt_len: int,
                       headers: dict[str, str] | None = None, chat: bool = False) -> RequestOutput:
    """POST one streaming completion; never raises: failures are recorded in `error`."""
    out = RequestOutput(prompt_len=prompt_len)
    st = time.perf_counter()
    reader = StreamReader(out, st, chat=chat)
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")[:500]
                out.error = f"HTTP {resp.status_code} {resp.reason_phrase}: {body}"
                return out
            async for line in resp.aiter_lines():
                reader.feed(line, time.perf_counter())
        reader.finish()
    except json.JSONDecodeError as e:
        out.success = False
        out.error = f"invalid JSON in the stream: {e}"
    except Exception as e:  # connection reset, timeout, ...
        out.success = False
        out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return out


async def send_backend_request(client: httpx.AsyncClient, base_url: str, backend: Backend,
                               model: str, req: BenchRequest,
                               headers: dict[str, str] | None = None) -> RequestOutput:
    """One request as `backend` makes it, to base_url + its endpoint."""
    return await send_request(client, base_url.rstrip("/") + backend.path,
                              backend.payload(model, req), req.prompt_len, headers, backend.chat)


def make_client(concurrency: int) -> httpx.AsyncClient:
    """A connection per request, closed after it, as InferenceX's client makes them (an aiohttp
    session per request). Kept alive, a pooled connection idle for about a server's keep-alive
    timeout can be closed by the server as the next request goes out on it: llama-server (5 s)
    dropped 2-48 requests of each C4-C64 run that way ("Server disconnected without sending a
    response"; httpx also keeps idle connections 5 s)."""
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 4, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits,
                             trust_env=False)


async def run_closed_loop(client: httpx.AsyncClient, base_url: str, backend: Backend, model: str,
                          requests: list[BenchRequest], concurrency: int,
                          headers: dict[str, str] | None = None,
                          on_done: Callable[[RequestOutput], None] | None = None
                          ) -> tuple[list[RequestOutput], float]:
    """All requests are created at once; a semaphore keeps `concurrency` of them in flight.

    Returns the outputs in request order and the wall time of the whole phase (seconds)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(req: BenchRequest) -> RequestOutput:
        async with sem:
            out = await send_backend_request(client, base_url, backend, model, req, headers)
        if on_done is not None:
            on_done(out)
        return out

    start = time.perf_counter()
    outputs = await asyncio.gather(*(asyncio.create_task(one(r)) for r in requests))
    return list(outputs), time.perf_counter() - start
