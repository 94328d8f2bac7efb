"""The FastAPI app: routes, API key, readiness and draining, error handling.

    POST /v1/completions, /v1/chat/completions   (streaming and not)
    POST /v1/responses                           (the Responses API; server/responses_api.py)
    GET, DELETE /v1/responses/{id}               (stored responses; server/response_store.py)
    GET  /v1/models, /health, /metrics, /version
    POST /tokenize, /detokenize                  (vLLM's shapes)

Around every route: BodyGuard (server/limits.py: the body is read within its size and time limits
before a route runs) and RequestGuard (arrival time, requests in flight, and unexpected exceptions
turned into a 500 that names an error id instead of the exception).
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field

from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from backboard.engine.async_llm import AsyncLLM
from backboard.server.errors import APIError, bad_request, error_body, install_error_handlers, internal_error
from backboard.server.limits import BodyGuard, ServerLimits, check_prompt_chars
from backboard.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from backboard.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    model_not_found,
)
from backboard.server.response_store import ResponseStore
from backboard.server.responses_api import ResponsesAPI, ResponsesRequest
from backboard.server.serving import GenerationHandler


@dataclass
class ServerState:
    engine: AsyncLLM
    tokenizer: object
    served_names: list[str]
    model_path: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: str | None = None
    stream_interval: int = 1
    limits: ServerLimits = field(default_factory=ServerLimits)
    reasoning_parser: str | None = None      # --reasoning-parser
    tool_call_parser: str | None = None      # --tool-call-parser
    draining: bool = False
    active_requests: int = 0               # HTTP requests in flight (their responses not done)
    frontend: bool = False                 # the page at / and its /api/ routes (server/frontend.py)
    scorecard_dir: str | None = None       # results folders the page's scorecard viewer lists
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_names[0]


def build_app(state: ServerState) -> FastAPI:
    from backboard import __version__

    app = FastAPI(title="Backboard", version=__version__)
    app.state.backboard = state
    gen = GenerationHandler(state.engine, state.tokenizer, state.model_name, state.stream_interval,
                            state.limits, state.max_model_len,
                            *output_parsers(state.reasoning_parser, state.tool_call_parser, state.tokenizer))
    state.limits = gen.limits                                  # resolved against max_model_len
    responses_api = ResponsesAPI(gen, ResponseStore(state.limits.max_stored_responses,
                                                    state.limits.max_stored_response_chars))
    app.add_middleware(BodyGuard, limits=state.limits)
    app.add_middleware(RequestGuard, state=state)              # outermost: sees every request
    install_error_handlers(app)
    api_key = state.api_key.encode() if state.api_key is not None else None

    # ---- checks --------------------------------------------------------------------------
    def authorized(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        scheme, _, key = auth.partition(" ")
        # constant time: how long the comparison takes says nothing about the key
        if not hmac.compare_digest(key.strip().encode(), api_key) or scheme.lower() != "bearer":
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def serving() -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down and takes no new requests")
        eng = state.engine
        if eng.state in ("new", "starting"):
            raise APIError(503, "the model is still loading; retry when /health answers 200")
        if eng.state != "ready":
            raise APIError(503, eng.error or "the engine is not running")

    def check_model(name: str | None) -> None:
        if name is not None and name not in state.served_names and name != state.model_path:
            raise model_not_found(name)

    # ---- generation -----------------------------------------------------------------------
    # The hot paths parse their body themselves (pydantic's JSON parser straight from bytes, plain
    # checks instead of dependency injection): a fraction of FastAPI's per-request cost.
    async def checked(raw: Request, model):
        """The request's body, once the key, the engine's readiness and the model name are checked."""
        authorized(raw)
        serving()
        req = await _parse_body(raw, model)
        check_model(req.model)
        return req

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(raw: Request) -> Response:
        return await gen.completions(await checked(raw, CompletionRequest), raw, _arrival(raw))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        return await gen.chat(await checked(raw, ChatCompletionRequest), raw, _arrival(raw))

    @app.post("/v1/responses", openapi_extra=_body_schema(ResponsesRequest))
    async def responses(raw: Request) -> Response:
        return await responses_api.create(await checked(raw, ResponsesRequest), raw, _arrival(raw))

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def get_response(response_id: str) -> dict:
        return responses_api.get(response_id)

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def delete_response(response_id: str) -> dict:
        return responses_api.delete(response_id)

    # ---- models, tokenizer ----------------------------------------------------------------
    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "backboard",
                 "root": state.model_path, "parent": None, "max_model_len": state.max_model_len}
                for name in state.served_names]
        return {"object": "list", "data": data}

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: dict = Body(...)) -> dict:
        if "messages" in body:
            req = _parse(TokenizeChatRequest, body)
            check_model(req.model)
            conv = req.conversation()
            check_prompt_chars(state.limits, sum(len(m["content"]) for m in conv), "messages")
            try:
                text = state.tokenizer.apply_chat_template(conv, req.add_generation_prompt,
                                                           **(req.chat_template_kwargs or {}))
            except Exception as e:  # noqa: BLE001
                raise bad_request(f"the chat template failed: {e}", "messages") from e
        else:
            req = _parse(TokenizeCompletionRequest, body)
            check_model(req.model)
            check_prompt_chars(state.limits, len(req.prompt), "prompt")
            text = req.prompt
        ids = await gen.encode(text, req.add_special_tokens)
        out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            out["token_strs"] = state.tokenizer.hf.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req.model)
        if len(req.tokens) > state.max_model_len:
            raise bad_request(f"at most {state.max_model_len} tokens (the context) can be detokenized; "
                              f"got {len(req.tokens)}", "tokens")
        bad = [t for t in req.tokens if not 0 <= t < len(state.tokenizer)]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range [0, {len(state.tokenizer)})", "tokens")
        text = await gen.off_loop(len(req.tokens) * 4, state.tokenizer.decode, req.tokens, skip_special_tokens=False)
        return {"prompt": text}

    # ---- operations -----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        eng = state.engine
        if state.draining:
            return JSONResponse(error_body("shutting down", "service_unavailable"), status_code=503)
        if eng.state == "ready":
            return Response(status_code=200)
        why = "the model is loading" if eng.state in ("new", "starting") else (eng.error or "engine stopped")
        return JSONResponse(error_body(why, "service_unavailable"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    if state.frontend:
        from backboard.server.frontend import install_frontend

        install_frontend(app, state, authorized)
    return app


def output_parsers(reasoning: str | None, tools: str | None, tokenizer):
    """The reasoning parser (an instance for this tokenizer) and the tool-call parser class named
    by the flags (None where not asked for); ValueError for an unknown name."""
    from backboard.server.reasoning import reasoning_parser
    from backboard.server.tool_parsers import tool_parser_class

    return (reasoning_parser(reasoning, tokenizer) if reasoning else None,
            tool_parser_class(tools) if tools else None)


class RequestGuard:
    """Pure ASGI middleware, outermost: the time a request reached the app (before its body is
    read: the arrival time of every latency the server reports), the count of requests in flight
    (a shutdown waits for their last events), and unexpected exceptions as a 500 with an error id
    (logged once, with the traceback; the exception's text never reaches the client)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.time()
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.state.active_requests += 1
        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:  # noqa: BLE001 - the last resort
            if started:
                logging.getLogger("backboard.server").error("error in a response already started (%s %s)",
                                                             scope["method"], scope["path"], exc_info=e)
                return
            await internal_error(scope["method"], scope["path"], e)(scope, receive, send)
        finally:
            self.state.active_requests -= 1


def _arrival(raw: Request) -> float:
    return getattr(raw.state, "arrival", None) or time.time()


async def _parse_body(raw: Request, model):
    try:
        return model.model_validate_json(await raw.body())
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e


def _body_schema(model) -> dict:
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": model.model_json_schema()}}}}


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e
