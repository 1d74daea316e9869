"""Bounded connections: a header deadline, a header size cap and a cap per client address.

uvicorn bounds none of these: a client that sends its headers one byte at a time keeps its
connection for as long as it likes (3,000 trickling connections were held indefinitely), and
httptools buffers an unfinished header without limit. They must be bounded here, below the app,
which sees a request only once its headers are complete. `GuardedHttpToolsProtocol` is uvicorn's
own httptools protocol plus, per connection:

- a deadline for each request's line and headers, from the connection's start or the request's
  first byte (`http.header_timeout_s`): past it the client gets a 408 and is disconnected;
- a cap on the bytes of an unfinished request line and headers (`http.max_header_bytes`): 431;
- a cap on the connections one client address holds at once (`http.max_connections_per_client`):
  the connection past it gets a 429 and is closed at once (a client still sending its request
  may see the close before the answer).

The body's deadline is the app's (`body_limit`, which reads every body before the routes do), so
a 408 there is logged and counted like any answer. Idle keep-alive connections are uvicorn's:
closed after its `timeout_keep_alive` (5 s).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loraplex.adapters_registry.base import ErrorKind
from loraplex.server.errors import ApiError, envelope
from loraplex.server.settings import HttpSettings


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_header_bytes: int
    max_per_client: int | None

    @classmethod
    def of(cls, http: HttpSettings) -> ConnectionLimits:
        return cls(http.header_timeout_s, http.max_header_bytes, http.max_connections_per_client)


class ClientConnections:
    """Open connections per client address, for one server."""

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._open: Counter[str] = Counter()

    def open(self, address: str) -> bool:
        """Count a new connection from `address`; False (and not counted) past the cap."""
        if self._limit is not None and self._open[address] >= self._limit:
            return False
        self._open[address] += 1
        return True

    def close(self, address: str) -> None:
        self._open[address] -= 1
        if self._open[address] <= 0:
            del self._open[address]

    def count(self, address: str) -> int:
        return self._open[address]


def refusal(kind: ErrorKind, message: str, code: str, setting: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, in OpenAI's error envelope."""
    error = ApiError(f"{message} (setting `http.{setting}`).", kind=kind, code=code)
    body = json.dumps(envelope(error)).encode()
    status = error.status
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring."""

    def __init__(
        self, *args: Any, limits: ConnectionLimits, clients: ClientConnections, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._clients = clients
        self._address: str | None = None  # set while this connection is counted
        self._deadline: asyncio.TimerHandle | None = None
        self._in_headers = False
        self._header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        if not self._clients.open(address):
            self._refuse(
                ErrorKind.RATE_LIMITED,
                f"This address holds {self._clients.count(address)} connections; at most "
                f"{self._limits.max_per_client} are allowed",
                "too_many_connections",
                "max_connections_per_client",
            )
            return
        self._address = address
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._address is not None:
            self._clients.close(self._address)
            self._address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # Checked after the parser saw the bytes: the chunk that ends the headers may carry
        # the start of a large body.
        if self._in_headers and self._header_bytes > self._limits.max_header_bytes:
            self._refuse(
                ErrorKind.HEADERS_TOO_LARGE,
                f"The request line and headers passed {self._limits.max_header_bytes} bytes",
                "headers_too_large",
                "max_header_bytes",
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_headers:  # a later request on a kept-alive connection
            self._await_headers()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()
        super().on_headers_complete()

    def _await_headers(self) -> None:
        self._in_headers = True
        self._header_bytes = 0
        self._disarm()
        self._deadline = self.loop.call_later(self._limits.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request's headers trickle in while the one before is answered:
            # nothing can be written between its bytes.
            self.transport.close()
            return
        seconds = self._limits.header_timeout_s
        self._refuse(
            ErrorKind.TIMEOUT,
            f"The request line and headers did not arrive within {seconds:g} s",
            "timeout",
            "header_timeout_s",
        )

    def _refuse(self, kind: ErrorKind, message: str, code: str, setting: str) -> None:
        self._disarm()
        self._in_headers = False
        if not self.transport.is_closing():
            self.transport.write(refusal(kind, message, code, setting))
            self.transport.close()


def guarded_protocol(http: HttpSettings) -> Any:
    """uvicorn's `http` argument: the protocol class, with this server's limits and counts."""
    limits = ConnectionLimits.of(http)
    clients = ClientConnections(limits.max_per_client)

    def protocol(*args: Any, **kwargs: Any) -> GuardedHttpToolsProtocol:
        return GuardedHttpToolsProtocol(*args, limits=limits, clients=clients, **kwargs)

    return protocol
