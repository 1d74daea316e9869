"""moto's S3 server in a process of its own, counting every request by client and kind.

    python -m bench.registry.counting_s3   # prints {"endpoint": URL} and serves until stdin closes

Each client signs with its own access key id (moto accepts any), so a request's client is the
`Credential=<id>/...` of its SigV4 Authorization header. Kinds: LIST (ListObjectsV2), GET, HEAD,
PUT, other; a GET is split by status (a 404 of a missing key, a 304 of an unchanged one).
`GET /__counts__` answers `{"<client> <kind> <status>": n, ...}` without reaching moto.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server

from bench.loadgen.server import free_port

COUNTS_PATH = "/__counts__"
_CREDENTIAL = re.compile(r"Credential=([^/]+)/")

StartResponse = Callable[..., Any]
Wsgi = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def request_kind(environ: dict[str, Any]) -> str:
    method = environ["REQUEST_METHOD"]
    if method == "GET" and "list-type=" in environ.get("QUERY_STRING", ""):
        return "LIST"
    return method if method in ("GET", "HEAD", "PUT") else "other"


class CountingApp:
    """WSGI middleware: counts each request under (client, kind, status), then lets moto answer."""

    def __init__(self, app: Wsgi) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with self._lock:
                body = json.dumps(dict(self._counts)).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        found = _CREDENTIAL.search(environ.get("HTTP_AUTHORIZATION", ""))
        client, kind = (found.group(1) if found else "anonymous"), request_kind(environ)

        def counted(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
            with self._lock:
                self._counts[f"{client} {kind} {status.split()[0]}"] += 1
            return start_response(status, headers, *rest)

        return self._app(environ, counted)


def main() -> None:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request access log
    port = free_port()
    app = CountingApp(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(json.dumps({"endpoint": f"http://127.0.0.1:{port}"}), flush=True)
    sys.stdin.read()  # until the bench closes our stdin (or dies)
    server.shutdown()


if __name__ == "__main__":
    main()
