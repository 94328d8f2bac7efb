"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure,
including FastAPI's own validation errors, unknown routes and unexpected exceptions. An unexpected
exception is logged with its traceback under an error id; the client gets the id, never the
exception's text."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """Raised anywhere in a handler; becomes an OpenAI error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(e.errors())
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), _TYPES.get(e.status_code, "invalid_request_error")),
                            status_code=e.status_code, headers=getattr(e, "headers", None))
    # anything else is a bug: server/api.py's RequestGuard answers with internal_error()


def internal_error(method: str, path: str, e: BaseException) -> JSONResponse:
    """A bug met while serving: the traceback to the log under an id; the id to the client."""
    eid = "err-" + uuid.uuid4().hex[:16]
    logger.error("internal error %s while serving %s %s", eid, method, path, exc_info=e)
    return JSONResponse(error_body(f"internal server error (error id {eid}; the server log has the details)",
                                   "server_error", code=500), status_code=500, headers={"x-error-id": eid})


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """FastAPI/pydantic errors -> (one readable message, the offending top-level field)."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"the request body is not valid JSON ({ctx.get('error', 'parse error')})", None
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
    # pydantic names union members in the location (e.g. 'str', 'list[int]'): keep field names
    names = [x for x in loc if not _is_type_tag(x)]
    param = next((x for x in names if not x.isdigit()), None)
    where = ".".join(names) if names else "body"
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        text = f"'{where}' is a required field"
    elif first.get("type") == "model_attributes_type" or where == "body":
        text = f"the request body must be a JSON object ({msg})"
    else:
        text = f"invalid value for '{where}': {msg} (got {_short(first.get('input'))})"
    if len(errors) > 1 and first.get("type") != "missing":
        text += f" [{len(errors)} validation errors]"
    return text, param


def _is_type_tag(x: str) -> bool:
    return x in ("str", "int", "float", "bool") or x.startswith(("list[", "dict[", "function-"))


def _short(v: Any) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
