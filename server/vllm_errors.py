"""vLLM's errors as loraplex answers them: one envelope (`errors.py`) whatever raised them.

vLLM's request models and serving objects refuse a request by raising (`VLLMValidationError`,
`ValueError`, `EngineDeadError`) or by returning an `ErrorResponse`, whose `code` is the HTTP
status. Both become loraplex's `ApiError`s: a 400 `invalid_value` naming vLLM's parameter (the
context length as OpenAI names it, `context_length_exceeded`), a 503 for a dead engine, any other
status by its kind (`errors.kind_of_status`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from loraplex.server.engine.client import as_invalid_request
from loraplex.server.errors import (
    ApiError,
    ContextLengthExceeded,
    EngineUnavailable,
    InvalidRequest,
    kind_of_status,
)

# What vLLM's renderer names the prompt in its length checks.
_VLLM_PROMPT_PARAMS = ("input_text", "input_tokens")


def _invalid(message: str, param: str | None) -> InvalidRequest:
    if "maximum context length" in message:
        return ContextLengthExceeded(message, param=param)
    return InvalidRequest(message, param=param)


def from_vllm_error(error: Exception) -> ApiError | None:
    """The client's answer for an exception vLLM raised about a request; None for a fault of
    the server's own."""
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(error, ApiError):
        return error
    if isinstance(error, EngineDeadError):
        return EngineUnavailable("The inference engine stopped.")
    invalid = as_invalid_request(error)
    return None if invalid is None else _invalid(invalid.message, invalid.param)


@contextmanager
def vllm_errors(prompt_field: str) -> Iterator[None]:
    """Raise what the block's vLLM calls raise as `ApiError`s, the prompt named by the request's
    own field (`messages`, `prompt`)."""
    try:
        yield
    except Exception as e:
        if (error := from_vllm_error(e)) is None:
            raise
        if error.param in _VLLM_PROMPT_PARAMS:
            error.param = prompt_field
        raise error from e


def answered(result: Any) -> Any:
    """A serving object's result, or its `ErrorResponse` raised as loraplex's error."""
    if type(result).__name__ != "ErrorResponse":
        return result
    error = result.error
    if error.code == 400:
        raise _invalid(error.message, error.param)
    raise ApiError(error.message, param=error.param, kind=kind_of_status(int(error.code)))
