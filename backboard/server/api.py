"""The FastAPI app: routes, API key, readiness and draining, error handling.

    POST /v1/completions, /v1/chat/completions   (streaming and not)
    GET  /v1/models, /health, /metrics, /version
    POST /tokenize, /detokenize                  (vLLM's shapes)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from backboard.engine.async_llm import AsyncLLM
from backboard.server.errors import APIError, bad_request, error_body, install_error_handlers
from backboard.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from backboard.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    model_not_found,
)
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
    draining: bool = False
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
    app.add_middleware(ArrivalStamp)
    install_error_handlers(app)
    gen = GenerationHandler(state.engine, state.tokenizer, state.model_name, state.stream_interval)

    # ---- checks --------------------------------------------------------------------------
    def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or key.strip() != state.api_key:
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
    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(raw: Request) -> Response:
        authorized(raw)
        serving()
        req = await _parse_body(raw, CompletionRequest)
        check_model(req.model)
        return await gen.completions(req, raw, _arrival(raw))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        authorized(raw)
        serving()
        req = await _parse_body(raw, ChatCompletionRequest)
        check_model(req.model)
        return await gen.chat(req, raw, _arrival(raw))

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
            try:
                text = state.tokenizer.apply_chat_template(req.conversation(), req.add_generation_prompt,
                                                           **(req.chat_template_kwargs or {}))
            except Exception as e:  # noqa: BLE001
                raise bad_request(f"the chat template failed: {e}", "messages") from e
        else:
            req = _parse(TokenizeCompletionRequest, body)
            check_model(req.model)
            text = req.prompt
        ids = await gen.encode(text, req.add_special_tokens)
        out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            out["token_strs"] = state.tokenizer.hf.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < len(state.tokenizer)]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range [0, {len(state.tokenizer)})", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

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


class ArrivalStamp:
    """Pure ASGI middleware: the time a request reached the app (before its body is read), the
    arrival time of every latency the server reports."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = time.time()
        await self.app(scope, receive, send)


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
