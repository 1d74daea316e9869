"""One error hierarchy for the gateway, mapped to HTTP in one place.

Every error a client can see is an `ApiError` (the registry's `AdapterError`s and Starlette's
HTTP errors are translated to one here). An error carries a kind
(`ErrorKind`) and a code; `HTTP` alone maps each kind to its status and OpenAI error type, and
the envelope `{"error": {"message", "type", "param", "code"}}` is rendered here alone, for the
exception handlers, a stream's error event and the middlewares that answer before any route.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.adapters_registry.base import AdapterError, ErrorKind

log = logging.getLogger(__name__)

# Each kind's HTTP status and OpenAI error type: the one table.
HTTP: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID: (400, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "invalid_request_error"),
    ErrorKind.FORBIDDEN: (403, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorKind.TIMEOUT: (408, "invalid_request_error"),
    ErrorKind.CONFLICT: (409, "invalid_request_error"),
    ErrorKind.TOO_LARGE: (413, "invalid_request_error"),
    # A client error that retrying will not fix (clients retry a 409 as transient).
    ErrorKind.UNPROCESSABLE: (422, "invalid_request_error"),
    ErrorKind.HEADERS_TOO_LARGE: (431, "invalid_request_error"),
    ErrorKind.RATE_LIMITED: (429, "requests"),  # OpenAI's type for rate limits
    # nginx's "client closed request": only ever recorded, nobody reads the answer.
    ErrorKind.CLIENT_CLOSED: (499, "invalid_request_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
    ErrorKind.NOT_IMPLEMENTED: (501, "server_error"),
    ErrorKind.UNAVAILABLE: (503, "server_error"),
}
_KIND_OF_STATUS = {status: kind for kind, (status, _) in HTTP.items()}


def kind_of_status(status: int) -> ErrorKind:
    """The kind of an HTTP status that someone else chose (Starlette's routing); a status the
    table lacks answers as its class's plain kind."""
    if status in _KIND_OF_STATUS:
        return _KIND_OF_STATUS[status]
    return ErrorKind.INVALID if status < 500 else ErrorKind.INTERNAL


class ApiError(Exception):
    """An error answered to the client. Subclasses fix the kind and the code; a translated
    error (`from_adapter_error`, `kind_of_status`) passes them in."""

    kind: ClassVar[ErrorKind] = ErrorKind.INTERNAL
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        kind: ErrorKind | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        if kind is not None:
            self.kind = kind  # type: ignore[misc]
        if code is not None:
            self.code = code

    @property
    def status(self) -> int:
        return HTTP[self.kind][0]

    @property
    def type(self) -> str:
        return HTTP[self.kind][1]


class InvalidRequest(ApiError):
    kind = ErrorKind.INVALID
    code = "invalid_value"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


# What an error quotes of a name the client sent, in UTF-8 bytes: the longest adapter reference
# (a 128-character name, `@`, a 64-digit version) is 193, so every real name is quoted whole.
MAX_ECHO_BYTES = 200


def echo(text: str) -> str:
    """`text` as an error may quote it: at most MAX_ECHO_BYTES bytes, cut between characters."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= MAX_ECHO_BYTES:
        return text
    return raw[: MAX_ECHO_BYTES - 3].decode("utf-8", "ignore") + "..."


class ModelNotFound(ApiError):
    kind = ErrorKind.NOT_FOUND
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{echo(model)}` does not exist or you do not have access to it.",
            param="model",
        )


class Unauthenticated(ApiError):
    kind = ErrorKind.UNAUTHENTICATED
    code = "invalid_api_key"


class RateLimited(ApiError):
    kind = ErrorKind.RATE_LIMITED
    code = "rate_limit_exceeded"


class EngineOverloaded(ApiError):
    kind = ErrorKind.UNAVAILABLE
    code = "engine_overloaded"


class EngineUnavailable(ApiError):
    kind = ErrorKind.UNAVAILABLE
    code = "engine_unavailable"


class NotFound(ApiError):
    kind = ErrorKind.NOT_FOUND
    code = "not_found"


def internal_error() -> ApiError:
    """What a client sees of a fault of the server's own: its details stay in the log."""
    return ApiError("Internal server error.", code="internal_error")


def envelope(error: ApiError) -> dict[str, Any]:
    """OpenAI's error body for `error`."""
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def error_response(error: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The whole response for `error`, with its own headers (Retry-After, WWW-Authenticate)
    and `headers`."""
    return JSONResponse(
        envelope(error), status_code=error.status, headers={**error.headers, **(headers or {})}
    )


def error_event(error: ApiError) -> str:
    """A stream's error event for `error` (after which the stream ends)."""
    return f"data: {json.dumps(envelope(error), separators=(',', ':'), allow_nan=False)}\n\n"


def from_adapter_error(error: AdapterError) -> ApiError:
    """The registry's error as the client sees it: its kind, code, message and field."""
    return ApiError(error.message, param=error.param, kind=error.kind, code=error.code)


# What pydantic appends to a location inside a union field (`prompt.str`,
# `stop.list[str]`, `function-after[...]`): a member's type, not a field.
_UNION_MEMBER = re.compile(r"(str|int|float|bool|none)|[a-z-]+\[.*\]")


def _describe_validation_error(err: dict[str, Any]) -> tuple[str | None, str]:
    """('messages.0.role', "`messages.0.role`: Input should be 'system', 'user' or ...").

    Checks across fields report no location; their message names the field first, in backticks.
    A body that is not JSON at all names no field (OpenAI's param null).
    """
    message = err.get("msg", "invalid value")
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    if err.get("type") == "json_invalid":  # its location is a byte offset
        return None, f"the body is not valid JSON (at byte {'.'.join(loc) or '?'}): {message}"
    # An unknown field's own name is the location's last part, whatever it reads like.
    last = loc[-1:] if err.get("type") == "extra_forbidden" else []
    field = [p for p in loc[: len(loc) - len(last)] if not _UNION_MEMBER.fullmatch(p)] + last
    if not field:
        named = re.search(r"`([A-Za-z_][A-Za-z_0-9.]*)`", message)
        return (named.group(1) if named else "body"), message
    param = ".".join(field)
    return param, f"`{param}`: {message}"


def _top_field(param: str | None) -> str | None:
    return None if param is None else param.split(".")[0]


def _deepest_of_first_field(described: list[tuple[str | None, str]]) -> tuple[str | None, str]:
    """Among the errors of the first field named, the one deepest inside it: a union field's
    member that got furthest names the real fault (`messages.0.content.0.text`, not the `str`
    member's "should be a valid string" at `messages.0.content`)."""
    if not described:
        return "body", "invalid"
    top = _top_field(described[0][0])
    same = [d for d in described if _top_field(d[0]) == top]
    return max(same, key=lambda d: len((d[0] or "").split(".")))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(AdapterError)
    async def _adapter_error(_: Request, exc: AdapterError) -> JSONResponse:
        return error_response(from_adapter_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        described = [_describe_validation_error(e) for e in exc.errors()]
        param, message = _deepest_of_first_field(described)
        # A union field reports one error per member type: one field's errors count once.
        top = _top_field(param)
        others = len({_top_field(p) for p, _ in described} - {top})
        if others:
            message += f" (and errors in {others} more fields)"
        return error_response(InvalidRequest(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(str(exc.detail), kind=kind_of_status(exc.status_code))
        return error_response(error, exc.headers)  # its headers too: a 405's Allow (RFC 9110)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(internal_error())
