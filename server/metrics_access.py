"""Who may read /metrics, and on which listener.

/metrics names every tenant and adapter and how much each sends, so it is not public. Two ways
to read it, independent of each other:

- `http.metrics_token`: the API's listener serves /metrics to a bearer of that token (or of the
  admin token), on any address, behind any proxy;
- `http.metrics_port`: a second listener on `http.metrics_host` serves /metrics (and nothing
  else) to whoever can reach that address, with no token: for scrapers that cannot send one.

/metrics/picker, the endpoint picker's share of /metrics (server/picker_metrics.py), follows the
same rules.

Without a token the API's listener serves /metrics only while it binds a loopback address (the
default 127.0.0.1: nobody off the host can connect) and no metrics listener is set; otherwise it
answers 404 (the metrics live on the other listener) or 403 naming the two settings.
`serving` opens the second listener; `MetricsListenerOnly` keeps everything but /metrics off it.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.adapters_registry.base import ErrorKind
from loraplex.server.errors import ApiError, NotFound, Unauthenticated, error_response
from loraplex.server.settings import HttpSettings

METRICS_PATH = "/metrics"
PICKER_METRICS_PATH = "/metrics/picker"


class MetricsNotExposed(ApiError):
    kind = ErrorKind.FORBIDDEN
    code = "metrics_not_exposed"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def on_listener(scope: Scope, port: int | None) -> bool:
    """Whether the request came in on the listener bound to `port`."""
    server = scope.get("server")
    return port is not None and server is not None and server[1] == port


def _bearer(authorization: str | None) -> bytes:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


class MetricsAccess:
    """The rules of the module docstring, for one server's settings."""

    def __init__(self, http: HttpSettings) -> None:
        self._port = http.metrics_port
        self._open_on_api = http.metrics_port is None and is_loopback(http.host)
        self._tokens = [
            t.get_secret_value().encode() for t in (http.metrics_token, http.admin_token) if t
        ]
        self._token_required = http.metrics_token is not None

    @property
    def warning(self) -> str | None:
        """What the server should log at start when nothing can read its /metrics."""
        if self._port is None and not self._token_required and not self._open_on_api:
            return (
                "/metrics answers 403: the server binds a non-loopback address and neither "
                "http.metrics_token nor http.metrics_port is set"
            )
        return None

    def check(self, scope: Scope, authorization: str | None) -> None:
        """Raise the error a scrape gets, or return if it may read /metrics."""
        if on_listener(scope, self._port):
            return  # the metrics listener: its address is the protection
        if self._token_required:
            given = _bearer(authorization)
            if not any(hmac.compare_digest(given, token) for token in self._tokens):
                raise Unauthenticated(
                    "/metrics needs `Authorization: Bearer <http.metrics_token>`.",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            return
        if self._port is not None:
            raise NotFound("Not Found")
        if not self._open_on_api:
            raise MetricsNotExposed(
                "/metrics is not served on this address: set `http.metrics_token` or "
                "`http.metrics_port`."
            )


class MetricsListenerOnly:
    """On the metrics listener, anything but /metrics (and /metrics/picker) is a 404 (the API
    stays off it)."""

    def __init__(self, app: ASGIApp, metrics_port: int | None) -> None:
        self.app = app
        self.metrics_port = metrics_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and on_listener(scope, self.metrics_port)
            and scope["path"] not in (METRICS_PATH, PICKER_METRICS_PATH)
        ):
            await error_response(NotFound("Not Found"))(scope, receive, send)
            return
        await self.app(scope, receive, send)
