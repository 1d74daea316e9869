"""Structured JSON access logs and per-request metrics, from one record per request.

A pure ASGI middleware (not `BaseHTTPMiddleware`, which buffers streaming bodies): it honours the
client's `x-request-id` (or generates one), returns it on the response, puts a `RequestRecord` in
`scope["state"]` for the handlers to fill in, and when the last body byte has been sent (or the
client went away) writes one JSON line and records the request's metrics.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.server.metrics import GatewayMetrics
from loraplex.server.tenancy.record import RequestRecord

log = logging.getLogger("loraplex.access")

REQUEST_ID_HEADER = "x-request-id"
_RECORD_KEY = "loraplex_record"
# Client-chosen ids are echoed into logs and headers: keep them short and printable.
_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def install_json_handler() -> None:
    """Write access lines to stderr as bare JSON (one object per line), apart from other logs."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def record_of(request: Request) -> RequestRecord | None:
    """The record of this request (None outside the middleware, e.g. in unit tests)."""
    return request.scope.get("state", {}).get(_RECORD_KEY)


class AccessLogMiddleware:
    def __init__(
        self, app: ASGIApp, metrics: GatewayMetrics | None, paths: tuple[str, ...] = ("/v1/",)
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex
        record = RequestRecord(request_id, scope["method"], scope["path"], time.monotonic())
        scope.setdefault("state", {})[_RECORD_KEY] = record

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and record.status >= 400:
                record.error_type = record.error_type or _error_code(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            record.status = record.status or 500
            record.error_type = record.error_type or "internal_error"
            raise
        finally:
            record.finished_at = time.monotonic()
            self._finish(record)

    def _finish(self, record: RequestRecord) -> None:
        if record.status >= 400 and record.error_type is None:
            record.error_type = f"http_{record.status}"
        log.info(json.dumps(access_line(record), separators=(",", ":")))
        if self.metrics is not None and record.path.startswith(self.paths):
            self.metrics.observe_request(record)


def _error_code(body: bytes) -> str | None:
    """The `code` (or `type`) of an OpenAI error envelope, so errors are counted by kind."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("code") or error.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def access_line(record: RequestRecord) -> dict[str, Any]:
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000.0, 3)

    otps = record.output_tokens_per_s

    return {
        "request_id": record.request_id,
        "method": record.method,
        "path": record.path,
        "status": record.status,
        "error_type": record.error_type,
        "tenant": record.tenant,
        "model": record.model,
        "adapter": record.adapter,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "queue_ms": ms(record.queued_s),
        "ttft_ms": ms(record.ttft_s),
        "output_tokens_per_s": None if otps is None else round(otps, 3),
        "e2e_ms": ms(record.e2e_s),
    }
