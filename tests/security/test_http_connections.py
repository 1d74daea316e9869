"""Issue 45, finding 7: connections are bounded. Real sockets against the shared server, whose
settings make the bounds short (tests/support/bystanders.py: headers within 2 s, a body within
3 s, 32 connections per client address).

Mallory connects from 127.0.0.2 (Linux routes all of 127/8 to the loopback device), so the cap
on her address leaves the bystanders' 127.0.0.1 alone while she holds it.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Iterator

from bench.loadgen.server import LiveServer
from tests.support.bystanders import CONFIG, MALLORY_KEY, Bystanders

MALLORY_ADDRESS = "127.0.0.2"
HEADER_TIMEOUT_S = CONFIG["http"]["header_timeout_s"]
BODY_TIMEOUT_S = CONFIG["http"]["body_timeout_s"]
PER_CLIENT = CONFIG["http"]["max_connections_per_client"]
# The deadline fires on the server's event loop; a loaded 2-core CI machine may run it late.
SLACK_S = 3.0


def _port(server: LiveServer) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def _connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(
        ("127.0.0.1", _port(server)), timeout=30, source_address=(MALLORY_ADDRESS, 0)
    )
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the one response the server sends before it closes."""
    data = b""
    with contextlib.suppress(ConnectionResetError):  # bytes the server never read reset it
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _trickle(sock: socket.socket, data: bytes, until: float, chunk: int = 1) -> float:
    """Send `data`, `chunk` bytes every 0.2 s, until the server answers or `until`; the
    seconds it took the server to answer. It stops sending once the answer is there, so no
    byte reaches a closed connection (which would reset it and lose the answer)."""
    start = time.monotonic()
    for i in range(0, len(data), chunk):
        if time.monotonic() > until or _answered(sock):
            break
        sock.sendall(data[i : i + chunk])
        time.sleep(0.2)
    while not _answered(sock) and time.monotonic() < until:
        time.sleep(0.05)
    return time.monotonic() - start


REQUEST_LINE = b"POST /v1/completions HTTP/1.1\r\nHost: loraplex\r\n"


def test_headers_that_trickle_get_a_408_at_the_deadline(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    """Ten connections trickle their headers a byte at a time (slowloris): each is answered 408
    naming the setting and closed once http.header_timeout_s has passed, not held."""
    socks = [_connect(shared_server) for _ in range(10)]
    try:
        deadline = time.monotonic() + HEADER_TIMEOUT_S + SLACK_S
        for sock in socks:
            sock.sendall(REQUEST_LINE[:5])
        endless = REQUEST_LINE + b"X-Slow: " + b"a" * 10_000
        took = _trickle(socks[0], endless[5:], until=deadline + 5)
        assert took <= HEADER_TIMEOUT_S + SLACK_S
        for sock in socks:
            status, body = _answer(sock)
            assert status == 408 and body["error"]["code"] == "timeout", body
            assert "http.header_timeout_s" in body["error"]["message"]
        assert time.monotonic() <= deadline
    finally:
        for sock in socks:
            sock.close()
    bystanders.assert_unchanged()


def test_a_body_that_trickles_gets_a_408_at_the_deadline(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    sock = _connect(shared_server)
    with contextlib.closing(sock):
        sock.sendall(
            REQUEST_LINE
            + f"Authorization: Bearer {MALLORY_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: 100000\r\n\r\n".encode()
        )
        took = _trickle(sock, b'{"model": "' + b"a" * 99_000, until=time.monotonic() + 30)
        status, body = _answer(sock)
    assert status == 408 and body["error"]["code"] == "timeout", body
    assert "http.body_timeout_s" in body["error"]["message"]
    assert took <= BODY_TIMEOUT_S + SLACK_S
    bystanders.assert_unchanged()


def test_headers_past_the_size_cap_get_a_431(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    """Headers that never end are refused once they pass http.max_header_bytes (64 KiB by
    default), not buffered until the deadline."""
    sock = _connect(shared_server)
    with contextlib.closing(sock):
        endless = REQUEST_LINE + b"X-Big: " + b"a" * (1024 * 1024)
        _trickle(sock, endless, until=time.monotonic() + 60, chunk=16 * 1024)
        status, body = _answer(sock)
    assert status == 431 and body["error"]["code"] == "headers_too_large", body
    assert "http.max_header_bytes" in body["error"]["message"]
    bystanders.assert_unchanged()


@contextlib.contextmanager
def _held(server: LiveServer, count: int) -> Iterator[list[socket.socket]]:
    socks = [_connect(server) for _ in range(count)]
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def test_one_address_holds_at_most_the_cap_of_connections(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    """Mallory holds the cap of idle connections; her next one is answered 429 naming the
    setting, while the bystanders, from another address, are served as before. Once hers
    close, she connects again."""
    with _held(shared_server, PER_CLIENT):
        time.sleep(0.2)  # every one of them accepted by the server
        with contextlib.closing(_connect(shared_server)) as extra:
            status, body = _answer(extra)
        assert status == 429 and body["error"]["code"] == "too_many_connections", body
        assert f"at most {PER_CLIENT}" in body["error"]["message"]
        assert "http.max_connections_per_client" in body["error"]["message"]
        bystanders.assert_unchanged()
    time.sleep(0.2)  # the server saw them close
    with contextlib.closing(_connect(shared_server)) as again:
        again.sendall(b"GET /health HTTP/1.1\r\nHost: loraplex\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := again.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
