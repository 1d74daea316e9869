"""One error hierarchy for the gateway, mapped to OpenAI's error envelope in one place.

Every error a client can see is an `ApiError` (or an `AdapterError` from the registry, translated
here). The body is always `{"error": {"message", "type", "param", "code"}}`, as OpenAI sends it.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.adapters_registry.base import AdapterError

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered to the client. Subclasses fix status, type and code."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class InvalidRequest(ApiError):
    status = 400
    type = "invalid_request_error"
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
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{echo(model)}` does not exist or you do not have access to it.",
            param="model",
        )


class Unauthenticated(ApiError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class RateLimited(ApiError):
    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class EngineOverloaded(ApiError):
    status = 503
    type = "server_error"
    code = "engine_overloaded"


class EngineUnavailable(ApiError):
    status = 503
    type = "server_error"
    code = "engine_unavailable"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


def error_body(
    message: str, type_: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(error.message, error.type, error.code, error.param),
        status_code=error.status,
        headers=error.headers,
    )


def as_api_error(error: AdapterError) -> ApiError:
    """The registry's errors carry their own HTTP status; keep it, wrap it in the envelope."""
    translated = ApiError(error.message, param=error.param)
    translated.status = error.http_status
    translated.code = error.code
    translated.type = "invalid_request_error" if error.http_status < 500 else "server_error"
    return translated


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
        return error_response(as_api_error(exc))

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
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(  # its headers too: a 405's Allow (RFC 9110)
            error_body(str(exc.detail), type_, None),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(
            error_body("Internal server error.", "server_error", "internal_error"),
            status_code=500,
        )
