"""One map from errors to HTTP (`server/errors.py`): every kind has one status and OpenAI type,
each error class answers as before the map, and the handler, the stream's error event and the
middlewares render one envelope."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.adapters_registry.base import (
    AdapterConflict,
    AdapterError,
    AdapterInvalid,
    AdapterNotFound,
    AdapterQuarantined,
    AdapterUnavailable,
    ErrorKind,
    ServableAdapter,
)
from loraplex.server import errors
from loraplex.server.body_limit import BodyTimeout, BodyTooLarge
from loraplex.server.connections import refusal
from loraplex.server.drain import ShuttingDown
from loraplex.server.engine.finite_guard import AdapterOutputNotFinite, OutputNotFinite
from loraplex.server.metrics_access import MetricsNotExposed
from loraplex.server.request_body import BodyParserUnavailable
from loraplex.server.routes.openai import ClientClosedRequest
from loraplex.server.tenancy import errors as tenancy_errors


def test_every_kind_has_one_status_and_type() -> None:
    assert set(errors.HTTP) == set(ErrorKind)
    statuses = [status for status, _ in errors.HTTP.values()]
    assert len(statuses) == len(set(statuses))
    for kind, (status, type_) in errors.HTTP.items():
        assert errors.kind_of_status(status) is kind
        assert (type_ == "server_error") == (status >= 500)


@pytest.mark.parametrize(
    ("error", "status", "type_", "code"),
    [
        (errors.InvalidRequest("x"), 400, "invalid_request_error", "invalid_value"),
        (
            errors.ContextLengthExceeded("x"),
            400,
            "invalid_request_error",
            "context_length_exceeded",
        ),
        (errors.ModelNotFound("m"), 404, "invalid_request_error", "model_not_found"),
        (errors.Unauthenticated("x"), 401, "invalid_request_error", "invalid_api_key"),
        (errors.RateLimited("x"), 429, "requests", "rate_limit_exceeded"),
        (errors.EngineOverloaded("x"), 503, "server_error", "engine_overloaded"),
        (errors.EngineUnavailable("x"), 503, "server_error", "engine_unavailable"),
        (errors.NotFound("x"), 404, "invalid_request_error", "not_found"),
        (errors.internal_error(), 500, "server_error", "internal_error"),
        (tenancy_errors.Unauthorized("x"), 401, "invalid_request_error", "invalid_api_key"),
        (
            tenancy_errors.RateLimited("x", reason="rpm", retry_after=2),
            429,
            "requests",
            "rate_limit_exceeded",
        ),
        (tenancy_errors.QueueFull("x"), 503, "server_error", "queue_full"),
        (
            tenancy_errors.QuotaStoreUnavailable("x", retry_after=1),
            503,
            "server_error",
            "quota_store_unavailable",
        ),
        (tenancy_errors.TenantNotFound("x"), 404, "invalid_request_error", "tenant_not_found"),
        (tenancy_errors.TenantConflict("x"), 409, "invalid_request_error", "tenant_conflict"),
        (
            tenancy_errors.RequestTooLarge("x", param="n", reason="max_running"),
            400,
            "invalid_request_error",
            "request_too_large",
        ),
        (BodyParserUnavailable("x"), 503, "server_error", "body_parser_unavailable"),
        (MetricsNotExposed("x"), 403, "invalid_request_error", "metrics_not_exposed"),
        (ClientClosedRequest("x"), 499, "invalid_request_error", "client_closed_request"),
        (BodyTimeout("x"), 408, "invalid_request_error", "timeout"),
        (BodyTooLarge("x"), 413, "invalid_request_error", "request_too_large"),
        (OutputNotFinite(0, 1), 503, "server_error", "non_finite_output"),
        (ShuttingDown(), 503, "server_error", "shutting_down"),
        (
            AdapterOutputNotFinite(0, 1, ServableAdapter("a", "v1", 1, Path("/a"), 8)),
            422,
            "invalid_request_error",
            "adapter_quarantined",
        ),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None,
)
def test_each_gateway_error_answers_with_its_status_type_and_code(
    error: errors.ApiError, status: int, type_: str, code: str
) -> None:
    assert (error.status, error.type, error.code) == (status, type_, code)
    response = errors.error_response(error)
    assert response.status_code == status
    assert json.loads(response.body)["error"] == {
        "message": error.message,
        "type": type_,
        "param": error.param,
        "code": code,
    }


@pytest.mark.parametrize(
    ("error", "status", "type_"),
    [
        (AdapterNotFound("x"), 404, "invalid_request_error"),
        (AdapterUnavailable("x"), 503, "server_error"),
        (AdapterInvalid("x", param="source"), 400, "invalid_request_error"),
        (AdapterQuarantined("x"), 422, "invalid_request_error"),
        (AdapterConflict("x"), 409, "invalid_request_error"),
        (AdapterError("x"), 500, "server_error"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None,
)
def test_registry_errors_answer_by_their_kind(error: AdapterError, status: int, type_: str) -> None:
    translated = errors.from_adapter_error(error)
    assert (translated.status, translated.type) == (status, type_)
    assert (translated.code, translated.message, translated.param) == (
        error.code,
        error.message,
        error.param,
    )


def test_a_streams_error_event_carries_the_handlers_envelope() -> None:
    error = tenancy_errors.QueueFull("The queue is full.")
    event = errors.error_event(error)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event.removeprefix("data: ")) == json.loads(errors.error_response(error).body)


def test_a_refused_connection_carries_the_envelope_and_its_kinds_status() -> None:
    raw = refusal(ErrorKind.HEADERS_TOO_LARGE, "Too big", "headers_too_large", "max_header_bytes")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large")
    assert json.loads(body)["error"] == {
        "message": "Too big (setting `http.max_header_bytes`).",
        "type": "invalid_request_error",
        "param": None,
        "code": "headers_too_large",
    }


def test_a_status_the_table_lacks_answers_as_its_class() -> None:
    assert errors.kind_of_status(418) is ErrorKind.INVALID
    assert errors.kind_of_status(502) is ErrorKind.INTERNAL
