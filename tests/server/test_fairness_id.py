"""/auth/fairness (server/routes/fairness.py): the Gateway's authorization check answers the
endpoint picker's fairness id from the key, never from what the client claims. The app's
tenancy is built as its lifespan builds it, without the engine the check does not use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from loraplex.server.app import create_app
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.routes.fairness import FAIRNESS_ID_HEADER
from loraplex.server.settings import Settings
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.service import Tenancy

ACME_KEY = "acme-key-for-the-fairness-test-0123456789"
ADMIN_TOKEN = "admin-token-for-the-fairness-test-0123456789"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = Settings.model_validate(
        {
            "http": {"admin_token": ADMIN_TOKEN},
            "tenancy": {"tenants": [{"id": "acme", "api_keys": [ACME_KEY]}]},
        }
    )
    app = create_app(settings)
    directory = TenantDirectory(settings.tenancy, None, settings.http.admin_token)
    metrics = GatewayMetrics(CollectorRegistry(), 0)
    app.state.tenancy = Tenancy(settings.tenancy, directory, metrics)
    yield TestClient(app)


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_a_tenant_key_gets_its_tenant_id_whatever_the_client_claims(
    client: TestClient, method: str
) -> None:
    r = client.request(
        method,
        "/auth/fairness/v1/chat/completions",
        headers={"Authorization": f"Bearer {ACME_KEY}", FAIRNESS_ID_HEADER: "someone-else"},
    )
    assert r.status_code == 200 and r.headers[FAIRNESS_ID_HEADER] == "acme"


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-key", f"Bearer {ADMIN_TOKEN}", f"Basic {ACME_KEY}"],
    ids=["none", "wrong", "admin-token", "basic-scheme"],
)
def test_anything_but_a_tenant_key_is_refused_as_v1_refuses_it(
    client: TestClient, authorization: str | None
) -> None:
    headers = {FAIRNESS_ID_HEADER: "acme"}
    if authorization:
        headers["Authorization"] = authorization
    r = client.post("/auth/fairness/v1/completions", headers=headers)
    assert r.status_code == 401, r.text
    assert FAIRNESS_ID_HEADER not in r.headers
    assert r.json()["error"]["code"] == "invalid_api_key"
