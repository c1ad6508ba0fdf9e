"""Errors over HTTP: one JSON shape (OpenAI's `{"error": {...}}`) for every failure.

`ApiError` is a 4xx/5xx answer a route raises; `from_library` maps the library's errors onto statuses (a
`PrintpressError` is the client's: 400; the scheduler's queue and timeouts: 429 and 408; anything else is a bug: a
logged 500); `install_error_handlers` answers FastAPI's own errors (pydantic's validation, 404, 405) in the same
shape, with one readable sentence that names the field. `ERROR_RESPONSES` documents the shapes in OpenAPI.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from printpress.errors import PrintpressError
from printpress.serve import protocol as p
from printpress.serve.scheduler import QueueFull, RequestFailed, RequestTimeout

logger = logging.getLogger(__name__)

ERROR_RESPONSES = {status: {"model": p.ErrorResponse, "description": text} for status, text in (
    (400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"), (408, "Timed out"),
    (413, "Body too large"), (429, "Queue full"))}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return p.ErrorResponse(error=p.ErrorBody(message=self.message, type=self.type, param=self.param,
                                                 code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_library(exc: Exception) -> ApiError:
    """The HTTP answer for an exception a route or a stream met."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, RequestTimeout):
        return ApiError(408, str(exc), "timeout_error", code="request_timeout")
    if isinstance(exc, RequestFailed):  # a bug that ended this request alone (the scheduler logged it)
        return ApiError(500, str(exc), "server_error", code="generation_failed")
    if isinstance(exc, PrintpressError):
        return ApiError(400, str(exc))
    logger.exception("internal error")
    return ApiError(500, "internal server error", "server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence for pydantic's error list, naming the field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = _most_telling(errors)
    param, union = _where(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    if kind == "missing" and param is None:
        return "the request body is empty; expected a JSON object", None
    if kind == "extra_forbidden":
        return f"unknown field '{param}' (not supported by this server)", param
    if kind == "missing":
        return f"missing required field '{param}'", param
    if param is None:
        return f"the body must be a JSON object: {first.get('msg')}", None
    if union is not None and kind != "value_error":  # no member of a union (str | list[int] | ...) took the value
        at = union[0]
        members = dict.fromkeys(u[1] for u in (_where(e.get("loc", ()))[1] for e in errors) if u and u[0] == at)
        return f"{at} has the wrong type: expected one of {', '.join(members)}", at
    message = str(first.get("msg", "")).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 and union is None else ""
    return f"{param}: {message}{more}", param


def _most_telling(errors: list[dict]) -> dict:
    """A failed check of a value (a lone surrogate, a bad chat name) says more than a union's wrong types."""
    return next((e for e in errors if e.get("type") == "value_error"), errors[0])


def _where(loc) -> tuple[str | None, tuple[str, str] | None]:
    """pydantic's error location as the field path a client wrote ("messages.0.content"), and, when it passes a
    union, the path up to it and the member it names ("str", "list[TextPart]": not fields, so not in the path)."""
    path: list[str] = []
    union = None
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int) or (part.isidentifier() and part.islower() and part not in _TYPE_NAMES):
            path.append(str(part))
        elif union is None:
            union = (".".join(path), part)
    return ".".join(path) or None, union


_TYPE_NAMES = frozenset({"str", "int", "float", "bool"})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind, headers=exc.headers).response()

    @app.exception_handler(PrintpressError)
    async def _library(request: Request, exc: PrintpressError):
        return from_library(exc).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        return from_library(exc).response()
