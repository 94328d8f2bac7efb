"""/v1/completions and /v1/chat/completions: request -> engine -> JSON or an SSE stream.

The response waits for the first token before it starts: an error before that point (the engine
refusing the request, the engine dying) is an ordinary HTTP error, and the first chunk of a stream
always carries a token. A client that goes away (while waiting, or mid-stream) aborts its request in
the engine, which frees its KV blocks and state slots.

The work done here per request is bounded (server/limits.py): n, stop strings and prompt
characters are checked before tokenizing, n x max_tokens and logprob entries before the request
is sent; long prompts are tokenized, and large non-streamed bodies built and encoded, on worker
threads, so no request stalls the event loop that serves everyone else."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from backboard.core.outputs import TokenLogprobs
from backboard.engine.async_llm import AsyncLLM
from backboard.engine.output_processor import InputError
from backboard.engine.request_stream import (
    CompletionDelta,
    EngineDeadError,
    RequestDelta,
    RequestRejected,
    RequestStream,
    ServerShuttingDown,
)
from backboard.engine.tokenizer import TokenizerError
from backboard.sample.grammar import GrammarError
from backboard.sampling_params import SamplingParams
from backboard.server import limits as L
from backboard.server import responses as R
from backboard.server.chat_output import ChoiceParser, finish_reason
from backboard.server.errors import APIError, bad_request, error_body
from backboard.server.prefix_hint import system_prefix_len
from backboard.server.protocol import ChatCompletionRequest, CompletionRequest
from backboard.server.reasoning import IN_CONTENT, IN_REASONING, MAY_OPEN, ReasoningParser
from backboard.server.structured import structured_spec, with_reasoning_gate
from backboard.server.tool_parsers import ToolParser
from backboard.server.tool_parsers.grammar import tool_choice_grammar

logger = logging.getLogger(__name__)

TIMING_HEADER = "x-backboard-timing"   # ask for the server-side timestamps in the usage chunk
_INLINE_TOKENIZE_CHARS = 2048          # longer texts are tokenized off the event loop
_INLINE_BODY_ENTRIES = 16384           # larger non-streamed bodies (tokens + logprob entries) are
#                                        built and encoded off the event loop


class ClientGone(Exception):
    """The client disconnected before the response started."""


@dataclass
class _Kind:
    """What differs between completions and chat completions."""

    object: str
    chunk_object: str
    id_prefix: str
    chat: bool


COMPLETION = _Kind("text_completion", "text_completion", "cmpl-", False)
CHAT = _Kind("chat.completion", "chat.completion.chunk", "chatcmpl-", True)


@dataclass
class _Call:
    """One HTTP generation call in flight."""

    kind: _Kind
    request_id: str
    model: str
    created: int
    stream: RequestStream
    params: SamplingParams
    include_usage: bool = False
    continuous_usage: bool = False
    want_timing: bool = False
    first_chunk_time: float | None = None
    parsers: list[ChoiceParser] | None = None     # chat with a reasoning / tool-call parser: per choice
    token_ids: bool = False                       # completions' return_token_ids


@dataclass
class _Pending:
    """A child's tokens not yet sent (stream interval > 1)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    has_logprobs: bool = False

    def add(self, d: CompletionDelta) -> None:
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.has_logprobs = True
            self.logprobs.extend(d.logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def take(self) -> tuple[str, list[int], list[TokenLogprobs] | None]:
        out = ("".join(self.text), self.token_ids, self.logprobs if self.has_logprobs else None)
        self.text, self.token_ids, self.logprobs, self.has_logprobs = [], [], [], False
        return out


class _Chunks:
    """A stream's state between chunks: tokens held back (stream interval > 1), which choices have
    started, each choice's logprob text offset, and the tokens sent so far."""

    def __init__(self, n: int) -> None:
        self.pending = [_Pending() for _ in range(n)]
        self.started = [False] * n
        self.offsets = [0] * n
        self.sent_tokens = 0

    def take_due(self, d: CompletionDelta, interval: int
                 ) -> tuple[str, list[TokenLogprobs] | None, list[int]] | None:
        """(text, logprobs, token ids) to send now for this completion, or None to hold them back."""
        p = self.pending[d.index]
        p.add(d)
        if d.finish_reason is None and p.num_tokens < interval:
            return None
        text, ids, lps = p.take()
        self.sent_tokens += len(ids)
        return text, lps, ids


class _Whole:
    """A non-streamed request's output, put together from its deltas."""

    def __init__(self, n: int) -> None:
        self.text: list[list[str]] = [[] for _ in range(n)]
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        self.finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        self.num_output_tokens = 0
        self.prompt_logprobs = None

    def add(self, d: RequestDelta) -> None:
        for c in d.outputs:
            self.text[c.index].append(c.text)
            self.token_ids[c.index].extend(c.token_ids)
            self.logprobs[c.index].extend(c.logprobs or ())
            self.finish[c.index] = (c.finish_reason, c.stop_reason)
        self.num_output_tokens = d.num_output_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs


class GenerationHandler:
    def __init__(self, engine: AsyncLLM, tokenizer, model_name: str, stream_interval: int = 1,
                 limits: L.ServerLimits | None = None, max_model_len: int = 1 << 30,
                 reasoning_parser: ReasoningParser | None = None,
                 tool_parser: type[ToolParser] | None = None) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.stream_interval = max(1, stream_interval)
        self.max_model_len = max_model_len
        self.limits = (limits or L.ServerLimits()).resolve(max_model_len)
        self.reasoning, self.tool_parser = reasoning_parser, tool_parser
        self.tt = R.TokenText(tokenizer)
        # one thread: the Rust tokenizer is not to be driven from several threads at once
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._body_pool = ThreadPoolExecutor(1, thread_name_prefix="respond")

    # ---- entry points ------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request, arrival: float) -> Response:
        params = self._params(req)
        params.structured_outputs = structured_spec(req)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            L.check_prompt_chars(self.limits, len(prompt), "prompt")
            text, ids = prompt, await self.encode(prompt)
        else:
            text, ids = None, list(prompt)
        return await self._generate(COMPLETION, req, raw, arrival, params, ids, text)

    async def chat(self, req: ChatCompletionRequest, raw: Request, arrival: float) -> Response:
        params, ids, text, parsers, hint = await self.prepare_chat(req)
        return await self._generate(CHAT, req, raw, arrival, params, ids, text, parsers, hint)

    async def start_chat(self, req: ChatCompletionRequest, raw: Request, arrival: float,
                         id_prefix: str = "resp_") -> "tuple[_Call, list[RequestDelta]] | None":
        """A chat request started in the engine, for another API's shape (/v1/responses): the call
        and its first deltas, or None when the client went away first."""
        params, ids, text, parsers, hint = await self.prepare_chat(req)
        return await self._start(replace(CHAT, id_prefix=id_prefix), req, raw, arrival, params, ids, text, parsers,
                                 hint)

    async def collect(self, call: "_Call", first: list[RequestDelta], raw: Request) -> dict | None:
        """The chat completion body of a started call once it is whole (None: the client went away)."""
        whole = await self._wait(self._gather(call, first), raw, call.request_id)
        return None if whole is None else self._body(call, whole)

    async def prepare_chat(self, req: ChatCompletionRequest):
        """(params, prompt ids, prompt text, per-choice output parsers) of a chat request; 400s for
        bad messages, tools or structured-output fields."""
        params = self._params(req)
        req.check_tools()
        conv = req.conversation()
        L.check_prompt_chars(self.limits, sum(len(m.get("content") or "") for m in conv), "messages")
        kw = dict(req.chat_template_kwargs or {})
        if req.active_tools:
            kw["tools"] = req.active_tools
        if req.continue_final_message:
            kw["continue_final_message"] = True
        add_gen = req.add_generation_prompt and not req.continue_final_message
        try:
            text = await self.off_loop(sum(len(m.get("content") or "") for m in conv),
                                        self.tokenizer.apply_chat_template, conv, add_gen, **kw)
        except TokenizerError as e:
            raise bad_request(str(e), "messages") from e
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise bad_request(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                              "messages") from e
        ids = await self.encode(text)
        hint = (await self.off_loop(len(text), system_prefix_len, self.tokenizer, conv, ids, **kw)
                if self._keeps_state_checkpoints() else 0)
        return params, ids, text, self._chat_outputs(req, params, ids, kw.get("enable_thinking")), hint

    def _keeps_state_checkpoints(self) -> bool:
        """Only a hybrid model's prefix cache uses the system-prompt hint (server/prefix_hint.py):
        elsewhere rendering the template a second time per chat request would be wasted."""
        c = self.engine.cfg
        return c.cache.enable_prefix_caching and c.model.is_hybrid

    def _chat_outputs(self, req: ChatCompletionRequest, params: SamplingParams, ids: list[int],
                      thinking: bool | None) -> list[ChoiceParser] | None:
        """Set the request's grammar (structured output, or the tool_choice one) and make each
        choice's output parser (None: plain text).

        The grammar waits for the end of the reasoning block when the prompt opened one, or when
        thinking was asked for (enable_thinking) and the model opens the block itself; otherwise it
        holds from the first token (a weak model would otherwise escape it into a block of its own)."""
        so = structured_spec(req)
        content_calls = so is None             # a structured-output answer is never read for calls
        tools = req.active_tools
        if tools and req.tool_choice not in (None, "auto", "none"):
            if self.tool_parser is None:
                raise bad_request("tool_choice required / a named function needs the server started with "
                                  "--tool-call-parser", "tool_choice")
            if so is not None:
                raise bad_request("tool_choice required / a named function cannot be combined with "
                                  "a structured-output field", "tool_choice")
            try:
                so = tool_choice_grammar(self.tool_parser, tools, req.tool_choice, req.parallel_tool_calls)
            except GrammarError as e:
                raise bad_request(str(e), e.param) from e
        state = self.reasoning.initial_state(ids, thinking is not False) if self.reasoning else IN_CONTENT
        if state == IN_REASONING or (state == MAY_OPEN and thinking is True):
            so = with_reasoning_gate(so, self.reasoning.think_token_ids, state == IN_REASONING)
        params.structured_outputs = so
        tool_parser = self.tool_parser(tools) if tools and self.tool_parser is not None else None
        if self.reasoning is None and tool_parser is None:
            return None
        return [ChoiceParser(self.reasoning, state, tool_parser, req.parallel_tool_calls, content_calls)
                for _ in range(params.n)]

    def _params(self, req) -> SamplingParams:
        params = req.sampling_params()
        L.check_params(self.limits, params)
        return params

    def group_of(self, req, rid: str) -> str:
        """What the engine's fair shares count this request under (EngineArgs.fairness)."""
        user = getattr(req, "user", None)
        if self.engine.cfg.scheduler.fairness == "user" and user:
            return "user:" + user
        return rid

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return await self.off_loop(len(text), self.tokenizer.encode, text, add_special_tokens)

    async def off_loop(self, size: int, fn, *args, **kw):
        if size <= _INLINE_TOKENIZE_CHARS:
            return fn(*args, **kw)
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, lambda: fn(*args, **kw))

    # ---- the common path ---------------------------------------------------------------------
    async def _generate(self, kind: _Kind, req, raw: Request, arrival: float, params: SamplingParams,
                        ids: list[int], text: str | None, parsers: list[ChoiceParser] | None = None,
                        prefix_hint: int = 0) -> Response:
        started = await self._start(kind, req, raw, arrival, params, ids, text, parsers, prefix_hint)
        if started is None:
            return Response(status_code=499)          # the client is gone (nobody reads this)
        call, first = started
        rid = call.request_id
        headers = {"x-request-id": rid}
        if req.stream:
            return SSEResponse(self._events(call, first), on_close=lambda: self.engine.abort(rid),
                               headers=headers)
        body = await self._wait(self._collect(call, first), raw, rid)
        if body is None:
            return Response(status_code=499)
        return Response(body, media_type="application/json", headers=headers)

    async def _start(self, kind: _Kind, req, raw: Request, arrival: float, params: SamplingParams,
                     ids: list[int], text: str | None, parsers: list[ChoiceParser] | None, prefix_hint: int = 0):
        """Add the request to the engine and wait for its first deltas: (call, first), or None
        when the client went away first. `prefix_hint`: see server/prefix_hint.py."""
        rid = kind.id_prefix + uuid.uuid4().hex
        if len(ids) < self.max_model_len:       # else the engine client says why (InputError)
            L.check_output(self.limits, params, len(ids), self.max_model_len, req.stream)
        try:
            stream = self.engine.add_request(ids, params, rid, prompt_text=text, arrival_time=arrival,
                                             group=self.group_of(req, rid),
                                             max_pending_tokens=self.limits.stream_buffer_tokens,
                                             prefix_hint=prefix_hint)
        except InputError as e:
            param = "max_tokens" if "max_tokens" in str(e) else ("messages" if kind.chat else "prompt")
            raise bad_request(str(e), param) from e
        except EngineDeadError as e:
            raise APIError(503, str(e)) from e
        call = _Call(kind, rid, req.model or self.model_name, int(time.time()), stream, params,
                     req.include_usage, req.continuous_usage, TIMING_HEADER in raw.headers, parsers=parsers,
                     token_ids=bool(getattr(req, "return_token_ids", False)))
        first = await self._wait(stream.get(), raw, rid)
        return None if first is None else (call, first)

    async def _wait(self, aw, raw: Request, rid: str):
        """Await part of a request before its response starts. None: the client went away (the
        request is aborted); the engine refusing it is a 400, the engine dying a 500."""
        try:
            return await _unless_disconnected(aw, raw)
        except ClientGone:
            self.engine.abort(rid)
            return None
        except RequestRejected as e:
            raise bad_request(str(e), "prompt") from e
        except ServerShuttingDown as e:
            raise APIError(503, str(e)) from e
        except EngineDeadError as e:
            raise APIError(500, str(e)) from e
        except BaseException:
            self.engine.abort(rid)
            raise

    async def _collect(self, call: _Call, first: list[RequestDelta]) -> bytes:
        """Wait for the whole request; the non-streaming body (JSON), built and encoded on a
        worker thread when it is large."""
        whole = await self._gather(call, first)
        size = whole.num_output_tokens * (1 + (call.params.logprobs or 0))
        if size <= _INLINE_BODY_ENTRIES and whole.prompt_logprobs is None:
            return R.dumps(self._body(call, whole)).encode()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._body_pool, self._encode_body, call, whole)

    async def _gather(self, call: _Call, first: list[RequestDelta]) -> "_Whole":
        """Every delta of the call, gathered."""
        whole = _Whole(call.params.n)
        deltas = first
        while deltas:
            for d in deltas:
                whole.add(d)
            deltas = await call.stream.get()
        return whole

    def _encode_body(self, call: _Call, whole: "_Whole") -> bytes:
        return "".join(R.dumps_pieces(self._body(call, whole, lp_text=True))).encode()

    def _body(self, call: _Call, whole: "_Whole", lp_text: bool = False) -> dict:
        """The whole response; `lp_text`: logprobs as encoded JSON (for dumps_pieces only)."""
        want_lp = call.params.logprobs is not None
        choices = [self._choice(call, whole, i, want_lp, lp_text) for i in range(call.params.n)]
        body = R.body(call.kind.object, call.request_id, call.created, call.model, choices,
                      R.usage(call.stream.num_prompt_tokens, whole.num_output_tokens, call.stream.num_cached_tokens))
        if call.want_timing:
            call.first_chunk_time = call.stream.timings.first_output
            body["backboard_timing"] = self._timing(call)
        return body

    def _choice(self, call: _Call, whole: "_Whole", i: int, want_lp: bool, lp_text: bool) -> dict:
        text, lps = "".join(whole.text[i]), whole.logprobs[i]
        finish, stop = whole.finish[i]
        if call.kind.chat:
            lp = R.chat_logprobs(lps, self.tt, lp_text) if want_lp else None
            if call.parsers is not None:
                parts = call.parsers[i].whole(text)
                calls = [c.as_openai() for c in parts.tool_calls]
                choice = R.chat_choice(i, parts.content, lp, finish_reason(finish, bool(calls)), stop,
                                       reasoning=parts.reasoning, tool_calls=calls)
            else:
                choice = R.chat_choice(i, text, lp, finish, stop)
        else:
            lp = R.completion_logprobs(lps, self.tt, 0, lp_text)[0] if want_lp else None
            choice = R.completion_choice(i, text, lp, finish, stop)
            if call.token_ids:
                choice["token_ids"] = whole.token_ids[i]
        if whole.prompt_logprobs is not None:
            choice["prompt_logprobs"] = R.prompt_logprobs(whole.prompt_logprobs, self.tt)
        return choice

    async def _events(self, call: _Call, first: list[RequestDelta]) -> AsyncIterator[bytes]:
        """The SSE stream: token chunks (stream_interval tokens each; the last group and the
        finish_reason always go out), then the usage chunk if asked, then [DONE]."""
        chunks = _Chunks(call.stream.n)
        deltas = first
        try:
            while deltas:
                events = self._sse_chunks(call, chunks, deltas)
                if events:
                    call.first_chunk_time = call.first_chunk_time or time.time()
                    yield b"".join(events)
                deltas = await call.stream.get()
        except EngineDeadError as e:
            yield R.sse(_stream_error(e))
            yield R.SSE_DONE
            return
        if call.include_usage:
            yield R.sse(self._usage_chunk(call, chunks.sent_tokens))
        yield R.SSE_DONE

    def _sse_chunks(self, call: _Call, chunks: "_Chunks", deltas: list[RequestDelta]) -> list[bytes]:
        """The events these deltas make due (none for tokens held back by the stream interval)."""
        events = []
        for d in (c for rd in deltas for c in rd.outputs):
            due = chunks.take_due(d, self.stream_interval)
            if due is None:
                continue
            choice = self._chunk_choice(call, chunks, d, *due)
            if choice is None:
                continue
            chunk = R.body(call.kind.chunk_object, call.request_id, call.created, call.model, [choice])
            if call.continuous_usage:
                chunk["usage"] = R.usage(call.stream.num_prompt_tokens, chunks.sent_tokens,
                                         call.stream.num_cached_tokens)
            events.append(R.sse(chunk))
        return events

    def _usage_chunk(self, call: _Call, sent_tokens: int) -> dict:
        final = R.body(call.kind.chunk_object, call.request_id, call.created, call.model, [],
                       R.usage(call.stream.num_prompt_tokens, sent_tokens, call.stream.num_cached_tokens))
        if call.want_timing:
            final["backboard_timing"] = self._timing(call)
        return final

    def _chunk_choice(self, call: _Call, chunks: "_Chunks", d: CompletionDelta, text: str, lps,
                      ids: list[int]) -> dict | None:
        i = d.index
        if call.kind.chat:
            lp = R.chat_logprobs(lps, self.tt) if lps is not None else None
            first = not chunks.started[i]
            chunks.started[i] = True
            if call.parsers is not None:
                return self._parsed_delta(call.parsers[i], d, text, first, lp)
            content = text if (text or first or d.finish_reason is None) else None
            return R.chat_delta_choice(i, content, first, lp, d.finish_reason, d.stop_reason)
        lp = None
        if lps is not None:
            lp, chunks.offsets[i] = R.completion_logprobs(lps, self.tt, chunks.offsets[i])
        choice = R.completion_choice(i, text, lp, d.finish_reason, d.stop_reason)
        if call.token_ids:
            choice["token_ids"] = ids
        return choice

    @staticmethod
    def _parsed_delta(p: ChoiceParser, d: CompletionDelta, text: str, first: bool, lp) -> dict | None:
        """A chunk of reasoning / content / tool-call deltas; None when the parser holds this text
        back (a marker may be starting) and there is nothing else to send."""
        dm = p.feed(text)
        if d.finish_reason is not None:
            dm = dm.add(p.finish())
        finish = finish_reason(d.finish_reason, p.num_calls > 0)
        if not dm and not first and finish is None and lp is None:
            return None
        calls = [t.as_openai() for t in dm.tool_calls] or None
        return R.chat_delta_choice(d.index, dm.content or None, first, lp, finish, d.stop_reason,
                                   reasoning=dm.reasoning or None, tool_calls=calls)

    def _timing(self, call: _Call) -> dict[str, Any]:
        d = call.stream.timings.as_dict()
        d["first_chunk"] = call.first_chunk_time
        return d


def _stream_error(e: EngineDeadError) -> dict:
    """The error event that ends a stream the server cannot finish."""
    if isinstance(e, ServerShuttingDown):
        return error_body(str(e), "service_unavailable", code=503)
    return error_body(str(e), "server_error", code=500)


async def _unless_disconnected(aw, raw: Request):
    """Await `aw`, unless the client disconnects first (then ClientGone)."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watch.cancel()
        raise
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    raise ClientGone()


async def _disconnected(raw: Request) -> None:
    while True:
        msg = await raw.receive()
        if msg["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always runs `on_close` (abort the request in the engine)
    when it ends, whether it completed, the client went away, or the server is stopping."""

    def __init__(self, content: AsyncIterator[bytes], on_close, headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except (RuntimeError, asyncio.CancelledError):
                    pass
