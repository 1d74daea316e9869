"""An HTTP proxy between loraplex and the S3 server that injects faults on object reads.

Requests pass through unchanged (SigV4 signs the Host header, which is forwarded as sent) except
GETs of keys containing `match` (e.g. "blobs/"), to which the armed faults apply in order:

- `fail(n, status, code)`: answer n requests with an S3 error (500 InternalError, 503 SlowDown);
- `reset(n)`: send the headers and half the body, then close the connection;
- `corrupt(n)`: flip bytes in the body (length unchanged, so only a hash check can tell);
- `slow(bytes_per_s)`: stream every matching body at that rate (until `slow(None)`).

`hits` counts matching requests, so tests can see that retries happened; `slow_bodies` records
each slowed body: its path, size, and when (`time.monotonic()`) its first and last bytes were sent;
`recent` keeps the last requests and those in flight (method, path, when they came and when they
were answered), so a failure can show whether the proxy answered at all.

Paths under `/__faults__/` are not forwarded: they arm faults and read `hits`, `slow_bodies` and
`recent`, so `tests.support.s3_rig` can run the proxy in a process of its own and drive it over
HTTP.
"""

from __future__ import annotations

import collections
import http.client
import json
import socket
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}
CONTROL = "/__faults__/"
_ACTIONS = {"fail", "reset", "corrupt", "slow", "clear"}


@dataclass(frozen=True)
class SlowBody:
    path: str
    size: int
    started: float
    sent: float

    @property
    def name(self) -> str:
        """The object's last path segment (a blob's sha256)."""
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Forwarded:
    """One forwarded request: `answered` is when its response was complete (None: it never was)."""

    method: str
    path: str
    came: float
    answered: float | None
    status: int | None


class _QuietServer(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5, and a replica opens more connections than that
    # at once (transfer threads, catalog and tenant polls). Once 5 wait for the accept thread the
    # kernel drops further SYNs, which botocore reports as connect timeouts: a CI run's replica
    # saw only those for minutes.
    request_queue_size = 128

    def handle_error(self, request: object, client_address: object) -> None:
        """A client hanging up mid-body (a killed server under test) is expected here."""


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, match: str = "blobs/") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.match = match
        self.hits = 0
        self._faults: list[tuple[str, int, str]] = []
        self.rate: float | None = None
        self.slow_bodies: list[SlowBody] = []
        self.recent: collections.deque[Forwarded] = collections.deque(maxlen=40)
        self.in_flight: dict[int, Forwarded] = {}  # by handler thread: one request at a time each
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fail(self, n: int, status: int = 500, code: str = "InternalError") -> None:
        with self._lock:
            self._faults += [("fail", status, code)] * n

    def reset(self, n: int) -> None:
        with self._lock:
            self._faults += [("reset", 0, "")] * n

    def corrupt(self, n: int) -> None:
        with self._lock:
            self._faults += [("corrupt", 0, "")] * n

    def slow(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
        self.rate = None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def state(self) -> dict[str, object]:
        return {
            "hits": self.hits,
            "slow_bodies": [asdict(b) for b in self.slow_bodies],
            "recent": [asdict(r) for r in [*self.recent, *self.in_flight.values()]],
        }

    def _next_fault(self, method: str, path: str) -> tuple[str, int, str] | None:
        if method != "GET" or self.match not in path:
            return None
        with self._lock:
            self.hits += 1
            return self._faults.pop(0) if self._faults else None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.path.startswith(CONTROL):
                    return self._control(self.path.removeprefix(CONTROL), body)
                came, status = time.monotonic(), None
                thread = threading.get_ident()
                proxy.in_flight[thread] = Forwarded(self.command, self.path, came, None, None)
                try:
                    status = self._forward(body)
                finally:
                    answered = time.monotonic() if status is not None else None
                    del proxy.in_flight[thread]
                    proxy.recent.append(Forwarded(self.command, self.path, came, answered, status))

            def _control(self, action: str, body: bytes | None) -> None:
                if action == "state":
                    reply = proxy.state()
                elif action in _ACTIONS:
                    getattr(proxy, action)(**json.loads(body or b"{}"))
                    reply = {}
                else:
                    return self._error(404, "NoSuchFaultAction")
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _forward(self, body: bytes | None) -> int:
                """Forward the request (or answer with an armed fault); returns the status sent."""
                fault = proxy._next_fault(self.command, self.path)
                if fault and fault[0] == "fail":
                    self._error(fault[1], fault[2])
                    return fault[1]
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                # A HEAD's answer has no body but names the object's size, as the upstream's did.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if fault and fault[0] == "reset" and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return resp.status
                if fault and fault[0] == "corrupt":
                    data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
                self._send_body(data, matching=proxy.match in self.path)
                return resp.status

            def _send_body(self, data: bytes, matching: bool) -> None:
                rate = proxy.rate if matching and self.command == "GET" else None
                if rate is None:
                    self.wfile.write(data)
                    return
                step = max(1, int(rate / 20))
                started = time.monotonic()
                for i in range(0, len(data), step):
                    self.wfile.write(data[i : i + step])
                    self.wfile.flush()
                    time.sleep(step / rate)
                body = SlowBody(self.path, len(data), started, time.monotonic())
                proxy.slow_bodies.append(body)

            def _error(self, status: int, code: str) -> None:
                body = (
                    f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                    f"<Message>injected {code}</Message></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

        return Handler
