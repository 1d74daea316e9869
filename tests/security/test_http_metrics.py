"""Issue 45, finding 4 (second half): /metrics needed no credentials and named every tenant,
adapter and version hash. On the shared server the API's listener serves it only to a bearer of
http.metrics_token (or the admin token), its metrics listener (http.metrics_port, 127.0.0.1)
serves it and nothing else, and no adapter's version appears in it on either.
"""

from __future__ import annotations

import re

import httpx
import pytest

from bench.loadgen.server import ADMIN_TOKEN, LiveServer
from tests.support.bystanders import (
    BOB_ADAPTER,
    MALLORY_KEY,
    METRICS_TOKEN,
    Bystanders,
    admin,
    metrics_text,
)


@pytest.mark.parametrize(
    "authorization",
    [None, f"Bearer {MALLORY_KEY}", "Bearer wrong-token", f"Basic {METRICS_TOKEN}", "Bearer"],
    ids=["none", "tenant-key", "wrong", "basic-scheme", "empty"],
)
def test_metrics_need_the_metrics_token_on_the_api_listener(
    shared_server: LiveServer, bystanders: Bystanders, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    r = httpx.get(shared_server.base_url + "/metrics", headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and "http.metrics_token" in error["message"]
    assert "loraplex_" not in r.text and "mallory" not in r.text


def test_the_metrics_and_admin_tokens_read_them(shared_server: LiveServer) -> None:
    assert "loraplex_requests_total" in metrics_text(shared_server)
    r = httpx.get(
        shared_server.base_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert r.status_code == 200 and "vllm:num_requests_running" in r.text


def test_the_metrics_listener_serves_metrics_and_nothing_else(
    shared_server: LiveServer, metrics_port: int
) -> None:
    listener = f"http://127.0.0.1:{metrics_port}"
    r = httpx.get(listener + "/metrics")
    assert r.status_code == 200 and "loraplex_requests_total" in r.text
    for path in ("/v1/models", "/health", "/admin/v1/adapters", "/docs"):
        r = httpx.get(listener + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert r.status_code == 404, (path, r.text[:200])
    r = httpx.post(
        listener + "/v1/completions",
        json={"model": "x", "prompt": "Hi"},
        headers={"Authorization": f"Bearer {MALLORY_KEY}"},
    )
    assert r.status_code == 404


def test_no_adapter_version_appears_in_metrics(
    shared_server: LiveServer, bystanders: Bystanders, metrics_port: int
) -> None:
    """Bob's adapter has run (the bystanders' requests) and stays in the engine's CPU cache:
    vllm:lora_adapter_loaded names it, and its version (the sha256 vLLM's LoRA name carries) is
    nowhere, on either listener."""
    bystanders.assert_unchanged()  # runs bob/helper and carol/helper again
    info = admin(shared_server, "GET", f"/admin/v1/adapters/{BOB_ADAPTER}").json()
    versions = {info["version"], *info["previous_versions"]}
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in versions), info
    for text in (metrics_text(shared_server),
                 httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text):  # fmt: skip
        for version in versions:
            assert version not in text and version[:8] not in text
        assert not re.search(r"@[0-9a-f]{8}", text)
        loaded = [
            line for line in text.splitlines() if line.startswith("vllm:lora_adapter_loaded{")
        ]
        assert any(f'adapter_name="{BOB_ADAPTER}"' in line for line in loaded), loaded
