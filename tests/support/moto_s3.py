"""moto's S3 server on loopback, for the tests that talk S3 (a real HTTP server, not a mock)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from moto.server import ThreadedMotoServer

from bench.loadgen.server import free_port


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, its endpoint yielded and the server stopped on exit; boto3
    speaks real HTTP + SigV4 to it. Test credentials go into the environment where none are set."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():  # fmt: skip
        os.environ.setdefault(key, value)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request access log
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
