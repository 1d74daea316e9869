"""`--model DIR` serves any Hugging Face directory; when the engine dies, the server says so:
/health and /ready turn 503 and requests get a 503 in OpenAI's envelope instead of hanging."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import psutil
import pytest

from bench.loadgen.polling import wait_until
from tests.support.server_process import ServerProcess


@pytest.fixture(scope="module")
def model_dir_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    model_dir = ensure_demo_model(default_cache_dir())
    # Its own cache dir: the adapter catalog there is empty, so only the base model is listed.
    server = ServerProcess(
        env={
            "LORAPLEX_ENGINE__SERVED_MODEL_NAME": "smol",
            "LORAPLEX_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
        },
        args=["--model", str(model_dir)],
    ).start()
    yield server
    server.stop()


def test_model_dir_is_served_under_its_configured_name(model_dir_server: ServerProcess) -> None:
    url = model_dir_server.base_url
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["smol"]
    reply = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": "smol", "prompt": "Hello", "max_tokens": 4},
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_engine_death_is_reported_unhealthy(model_dir_server: ServerProcess) -> None:
    url = model_dir_server.base_url
    assert model_dir_server.proc is not None
    cores = [
        p
        for p in psutil.Process(model_dir_server.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()
    ]
    assert cores, "no vLLM engine-core process found under the server"
    for core in cores:
        core.kill()
    wait_until(lambda: httpx.get(url + "/health").status_code == 503, 30)
    assert httpx.get(url + "/health").status_code == 503
    assert httpx.get(url + "/ready").status_code == 503
    reply = httpx.post(
        url + "/v1/completions",
        timeout=30,
        json={"model": "smol", "prompt": "Hello", "max_tokens": 4},
    )
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "engine_unavailable"
