"""The standing isolation suite's shared server: one real `loraplex serve` for the package.

Tenants, bystanders and what each case asserts: tests/support/bystanders.py. One server for the
whole package (scope "package"): an engine start costs ~30 s on the 2-core CI machine. A case
that must kill or restart a server starts its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.loadgen.server import LiveServer, free_port, live_server
from loraplex.server.settings import default_cache_dir
from tests.support.bystanders import BOB_ADAPTER, CAROL_ADAPTER, CONFIG, Bystanders, admin


@pytest.fixture(scope="package")
def metrics_port() -> int:
    """The shared server's metrics listener (http.metrics_port), on 127.0.0.1."""
    return free_port()


@pytest.fixture(scope="package")
def shared_server(
    tmp_path_factory: pytest.TempPathFactory, metrics_port: int
) -> Iterator[LiveServer]:
    config = {**CONFIG, "http": {**CONFIG["http"], "metrics_port": metrics_port}}
    with live_server(config, tmp_path_factory.mktemp("security")) as live:
        demo = default_cache_dir() / "demo-adapters"
        for name, folder in ((BOB_ADAPTER, "demo-attn"), (CAROL_ADAPTER, "demo-mlp")):
            r = admin(
                live,
                "POST",
                "/admin/v1/adapters",
                json={"name": name, "source": str(demo / folder)},
            )
            assert r.status_code == 201, r.text
        yield live


@pytest.fixture(scope="package")
def bystanders(shared_server: LiveServer) -> Bystanders:
    watch = Bystanders(shared_server)
    watch.clean = watch.outputs()
    assert all(not text.startswith("HTTP ") for text in watch.clean), watch.clean
    return watch
