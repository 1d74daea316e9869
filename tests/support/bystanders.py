"""The standing isolation suite's tenants and bystanders (fixtures in tests/security/conftest.py).

Three tenants share one engine: `mallory` sends what an attacker or a careless customer would
(bad adapters, bad settings, huge prompts, `n`), `bob` and `carol` are bystanders. Each case
attacks through mallory, then asserts with `bystanders.assert_unchanged()` that bob's and carol's
greedy outputs (base model and their own adapters) are byte-identical to the clean run taken when
the server started, before any attack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.loadgen.server import ADMIN_TOKEN, LiveServer

MALLORY_KEY = "mallory-key-for-security-tests-0123"
BOB_KEY = "bob-key-for-security-tests-0123456"
CAROL_KEY = "carol-key-for-security-tests-01234"
BOB_ADAPTER = "bob/helper"
CAROL_ADAPTER = "carol/helper"

METRICS_TOKEN = "metrics-token-for-security-tests-0123456789"

CONFIG: dict[str, Any] = {
    # fp32: greedy tokens on the CPU engine do not depend on batch composition in practice, so
    # a bystander's output beside an attack can be compared byte for byte with its clean run.
    "engine": {"dtype": "float32"},
    # /metrics needs METRICS_TOKEN on the API's listener (`metrics_text`); the conftest adds a
    # metrics listener (http.metrics_port) on a free port. Read deadlines and the cap per client
    # address are short, so the connection cases run in seconds.
    "http": {
        "admin_token": ADMIN_TOKEN,
        "metrics_token": METRICS_TOKEN,
        "header_timeout_s": 2.0,
        "body_timeout_s": 3.0,
        "max_connections_per_client": 32,
    },
    "tenancy": {
        "tenants": [
            {"id": "mallory", "api_keys": [MALLORY_KEY]},
            {"id": "bob", "api_keys": [BOB_KEY]},
            {"id": "carol", "api_keys": [CAROL_KEY]},
        ],
    },
}


def admin(server: LiveServer, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=120, **kw)


def as_tenant(
    server: LiveServer, key: str, path: str, body: dict[str, Any], timeout: float = 120
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=timeout)


def metrics_text(server: LiveServer) -> str:
    """The shared server's /metrics, read with its metrics token."""
    headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    r = httpx.get(server.base_url + "/metrics", headers=headers, timeout=30)
    r.raise_for_status()
    return r.text


def base_model(server: LiveServer) -> str:
    r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {BOB_KEY}"})
    return str(r.json()["data"][0]["id"])


@dataclass
class Bystanders:
    """Bob's and Carol's fixed greedy requests, and their outputs on the clean server."""

    server: LiveServer
    clean: list[str] = field(default_factory=list)

    def requests(self) -> list[tuple[str, str, dict[str, Any]]]:
        base = base_model(self.server)
        greedy = {"temperature": 0, "max_tokens": 12}
        chat = [{"role": "user", "content": "Name three rivers in Europe."}]
        return [
            (BOB_KEY, "/v1/chat/completions", {"model": base, "messages": chat, **greedy}),
            (BOB_KEY, "/v1/completions", {"model": BOB_ADAPTER, "prompt": "The sea", **greedy}),
            (CAROL_KEY, "/v1/completions", {"model": base, "prompt": "Once upon", **greedy}),
            (
                CAROL_KEY,
                "/v1/chat/completions",
                {"model": CAROL_ADAPTER, "messages": chat, **greedy},
            ),
        ]

    def outputs(self) -> list[str]:
        """Each request's text, in order; a failed request is its status and body."""
        texts = []
        for key, path, body in self.requests():
            r = as_tenant(self.server, key, path, body)
            if r.status_code != 200:
                texts.append(f"HTTP {r.status_code}: {r.text}")
                continue
            choice = r.json()["choices"][0]
            texts.append(choice["message"]["content"] if "message" in choice else choice["text"])
        return texts

    def assert_unchanged(self) -> None:
        assert self.outputs() == self.clean
