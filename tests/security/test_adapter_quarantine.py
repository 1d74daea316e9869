"""A quarantined adapter on the shared server: its tenant gets a clear 422 naming it and why, no
other tenant learns of it, the admin clears it, and the bystanders' outputs never change.

The engine guard that quarantines an adapter whose logits go non-finite is tested with the
guard; here the admin API quarantines, through the same registry call."""

from __future__ import annotations

from bench.loadgen.server import LiveServer
from loraplex.server.settings import default_cache_dir
from tests.support.bystanders import BOB_KEY, MALLORY_KEY, Bystanders, admin, as_tenant

ADAPTER = "mallory/quarantined"
GREEDY = {"temperature": 0, "max_tokens": 4}


def _ask(server: LiveServer, key: str) -> tuple[int, dict]:
    r = as_tenant(server, key, "/v1/completions", {"model": ADAPTER, "prompt": "Hi", **GREEDY})
    return r.status_code, r.json()


def test_a_quarantined_adapter_is_a_422_for_its_tenant_until_cleared(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    demo = default_cache_dir() / "demo-adapters" / "demo-attn"
    r = admin(
        shared_server, "POST", "/admin/v1/adapters", json={"name": ADAPTER, "source": str(demo)}
    )
    assert r.status_code == 201, r.text
    assert _ask(shared_server, MALLORY_KEY)[0] == 200

    why = "non-finite logits in request cmpl-1"
    r = admin(
        shared_server, "POST", f"/admin/v1/adapters/{ADAPTER}/quarantine", json={"reason": why}
    )
    assert r.status_code == 200, r.text
    assert r.json()["health"] == "quarantined" and r.json()["quarantine_reason"] == why
    status, body = _ask(shared_server, MALLORY_KEY)
    assert status == 422, body
    error = body["error"]
    assert error["code"] == "adapter_quarantined" and error["type"] == "invalid_request_error"
    assert error["param"] == "model" and ADAPTER in error["message"] and why in error["message"]
    stream = as_tenant(
        shared_server, MALLORY_KEY, "/v1/chat/completions",
        {"model": ADAPTER, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
         **GREEDY},
    )  # fmt: skip
    assert stream.status_code == 422 and stream.json()["error"]["code"] == "adapter_quarantined"
    # Another tenant cannot tell a quarantined adapter from one that does not exist.
    status, body = _ask(shared_server, BOB_KEY)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert f"adapter {ADAPTER} version" in shared_server.log_text()
    bystanders.assert_unchanged()

    too_long = admin(
        shared_server, "POST", f"/admin/v1/adapters/{ADAPTER}/quarantine",
        json={"reason": "x" * 201},
    )  # fmt: skip
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "reason"

    r = admin(shared_server, "POST", f"/admin/v1/adapters/{ADAPTER}/unquarantine")
    assert r.status_code == 200 and r.json()["health"] == "healthy", r.text
    assert _ask(shared_server, MALLORY_KEY)[0] == 200
    assert admin(shared_server, "DELETE", f"/admin/v1/adapters/{ADAPTER}").status_code == 200
    bystanders.assert_unchanged()
