"""Tenant isolation, quotas, the fair queue and the admin API over HTTP, on one real server.

The server is `loraplex serve` with the vllm-cpu engine and the embedded model; namespaced
adapters are registered through `/admin/v1/adapters` from the demo adapters' folders.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from bench.loadgen.polling import wait_until
from bench.loadgen.server import ADMIN_TOKEN, LiveServer, live_server
from loraplex.server.settings import default_cache_dir

ACME_KEY = "acme-key-for-tests-0123456789"
GLOBEX_KEY = "globex-key-for-tests-0123456789"
LIMITED_KEY = "limited-key-for-tests-0123456789"
BASIC_AUTH = "Basic dXNlcjpwYXNz"  # not a bearer token at all
ACME_ADAPTER = "acme/bot"
GLOBEX_ADAPTER = "globex/secret-bot"

CONFIG = {
    "http": {"admin_token": ADMIN_TOKEN},
    "tenancy": {
        "max_running": 2,
        "max_queued": 2,
        # Other tests' tenants must not keep slots reserved during the queue test.
        "active_window_s": 0.5,
        "tenants": [
            {"id": "acme", "display_name": "Acme", "api_keys": [ACME_KEY]},
            {"id": "globex", "display_name": "Globex Corp", "api_keys": [GLOBEX_KEY]},
            {"id": "limited", "api_keys": [LIMITED_KEY], "quotas": {"requests_per_minute": 2}},
        ],
        # Tenants created through the admin API by the prefix-cache test.
        "share_prefix_cache": {"partners": ["partner-a", "partner-b"]},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(CONFIG, tmp_path_factory.mktemp("tenancy-http")) as live:
        demo = default_cache_dir() / "demo-adapters"
        for name, folder in ((ACME_ADAPTER, "demo-attn"), (GLOBEX_ADAPTER, "demo-mlp")):
            r = admin(
                live,
                "POST",
                "/admin/v1/adapters",
                json={"name": name, "source": str(demo / folder)},
            )
            assert r.status_code == 201, r.text
        yield live


def admin(server: LiveServer, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=60, **kw)


def call(
    server: LiveServer, key: str | None, model: str, *, path: str = "/v1/completions", **extra: Any
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, **extra}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120)


def base_model(server: LiveServer) -> str:
    r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {ACME_KEY}"})
    return str(r.json()["data"][0]["id"])


def error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def test_open_default_is_off_and_says_which_mode_in_the_log(server: LiveServer) -> None:
    assert "3 tenants, API keys required on /v1" in server.log_text()


@pytest.mark.parametrize(
    "key", [None, BASIC_AUTH, "wrong-key-0123456789abcdef", ACME_KEY.upper(), ADMIN_TOKEN]
)
@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/chat/completions"])
def test_no_wrong_or_admin_key_is_401(server: LiveServer, key: str | None, path: str) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    if key == BASIC_AUTH:
        headers = {"Authorization": BASIC_AUTH}
    body = {"model": base_model(server), "prompt": "Hi", "max_tokens": 1}
    if path.endswith("chat/completions"):
        body = {"model": body["model"], "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.request(
        "GET" if path == "/v1/models" else "POST",
        server.base_url + path,
        headers=headers,
        json=None if path == "/v1/models" else body,
    )
    assert r.status_code == 401, r.text
    assert error(r)["code"] == "invalid_api_key"
    assert "acme" not in r.text.lower() and "globex" not in r.text.lower()


@pytest.mark.parametrize("path", ["/admin/v1/tenants", "/admin/v1/adapters"])
@pytest.mark.parametrize("key", [ACME_KEY, GLOBEX_KEY, None])
def test_tenant_keys_cannot_call_admin_routes(
    server: LiveServer, path: str, key: str | None
) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(server.base_url + path, headers=headers)
    assert r.status_code == 401, r.text
    assert error(r)["code"] == "invalid_api_key"


def test_models_lists_only_what_the_caller_may_use(server: LiveServer) -> None:
    for key, own, other in (
        (ACME_KEY, ACME_ADAPTER, GLOBEX_ADAPTER),
        (GLOBEX_KEY, GLOBEX_ADAPTER, ACME_ADAPTER),
    ):
        r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        ids = [m["id"] for m in r.json()["data"]]
        assert own in ids and other not in ids
        assert other.split("/")[0] not in r.text


def _version_of(server: LiveServer, name: str) -> str:
    r = admin(server, "GET", f"/admin/v1/adapters/{name}")
    assert r.status_code == 200, r.text
    return str(r.json()["version"])


def test_other_tenants_adapters_look_exactly_like_missing_ones(server: LiveServer) -> None:
    version = _version_of(server, GLOBEX_ADAPTER)
    attempts = [
        GLOBEX_ADAPTER,
        f"{GLOBEX_ADAPTER}@{version}",
        f"{GLOBEX_ADAPTER}@{version[:12]}",
        "Globex/secret-bot",
        "GLOBEX/SECRET-BOT",
        "gl\u043ebex/secret-bot",  # Cyrillic о
        "globex/secret-b\u03bft",  # Greek ο
        "globex\u200b/secret-bot",  # zero-width space
        "acme/../globex/secret-bot",
        "ACME/bot",  # case look-alike of acme's own adapter
        "\u0430cme/bot",  # Cyrillic а: not acme's namespace either
    ]
    missing = call(server, ACME_KEY, "acme/does-not-exist")
    assert missing.status_code == 404
    template = error(missing)
    for name in attempts:
        r = call(server, ACME_KEY, name)
        assert r.status_code == 404, (name, r.text)
        body = error(r)
        assert body["code"] == "model_not_found" and body["param"] == "model"
        assert body["type"] == template["type"]
        assert body["message"] == template["message"].replace("acme/does-not-exist", name)
        rest = json.dumps({**body, "message": body["message"].replace(name, "")})
        assert version[:12] not in rest and "secret" not in rest and "globex" not in rest, name


def test_own_adapter_by_name_and_version_serves(server: LiveServer) -> None:
    version = _version_of(server, ACME_ADAPTER)
    for model in (ACME_ADAPTER, f"{ACME_ADAPTER}@{version}"):
        r = call(server, ACME_KEY, model)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    assert call(server, GLOBEX_KEY, GLOBEX_ADAPTER).status_code == 200
    assert call(server, GLOBEX_KEY, ACME_ADAPTER).status_code == 404


def test_request_quota_answers_429_with_retry_after(server: LiveServer) -> None:
    model = base_model(server)
    statuses = [call(server, LIMITED_KEY, model).status_code for _ in range(3)]
    assert statuses[:2] == [200, 200]
    r = call(server, LIMITED_KEY, model)
    assert r.status_code == 429
    assert error(r)["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert call(server, ACME_KEY, model).status_code == 200  # other tenants unaffected


def _metric(server: LiveServer, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_full_queue_is_503_and_cancelled_queued_requests_never_reach_the_engine(
    server: LiveServer,
) -> None:
    """max_running=2, max_queued=2: two long requests run, two wait, the fifth is refused.

    The two waiting ones are cancelled by their clients; vLLM's own prompt-token counter then
    grows by exactly the two running requests' prompts (the cancelled prompts are longer, and
    distinct, so any leak would show).
    """
    model = base_model(server)
    time.sleep(1.0)  # past tenancy.active_window_s: acme is the only active tenant
    prompt_before = _metric(server, "vllm:prompt_tokens_total")

    async def scenario() -> int:
        client = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key=ACME_KEY, max_retries=0
        )

        async def stream(prompt: list[int], max_tokens: int) -> None:
            s = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for _ in s:
                pass

        running = [asyncio.create_task(stream([1000 + i] * 7, 200)) for i in range(2)]
        await asyncio.sleep(1.0)
        queued = [asyncio.create_task(stream([2000 + i] * 101, 4)) for i in range(2)]
        await asyncio.sleep(1.0)
        try:
            await client.completions.create(model=model, prompt="x", max_tokens=1)
            status = 200
        except openai.APIStatusError as e:
            status = e.status_code
        assert not any(t.done() for t in running), "the long requests ended too early"
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        await asyncio.gather(*running)
        await client.close()
        return status

    status = asyncio.run(scenario())
    assert status == 503
    wait_until(lambda: _metric(server, "loraplex_requests_queued") == 0, 10)
    assert _metric(server, "loraplex_requests_queued") == 0
    assert _metric(server, "loraplex_requests_running") == 0
    assert _metric(server, "vllm:prompt_tokens_total") - prompt_before == 2 * 7
    assert _metric(server, "vllm:num_requests_running") == 0
    text = httpx.get(server.base_url + "/metrics").text
    assert 'loraplex_rejections_total{reason="queue_full",tenant="acme"} 1.0' in text


def test_admin_creates_rotates_and_deletes_a_tenant(server: LiveServer) -> None:
    created = admin(server, "POST", "/admin/v1/tenants", json={"id": "initech", "weight": 2})
    assert created.status_code == 201, created.text
    key = created.json()["api_key"]
    assert key.startswith("lpx-")
    listing = admin(server, "GET", "/admin/v1/tenants")
    assert key not in listing.text and "initech" in listing.text
    assert admin(server, "GET", "/admin/v1/tenants/initech").json()["weight"] == 2
    model = base_model(server)
    assert call(server, key, model).status_code == 200
    assert (
        httpx.get(
            server.base_url + "/admin/v1/tenants", headers={"Authorization": f"Bearer {key}"}
        ).status_code
        == 401
    )
    assert admin(server, "POST", "/admin/v1/tenants", json={"id": "initech"}).status_code == 409
    assert admin(server, "PATCH", "/admin/v1/tenants/acme", json={"weight": 3}).status_code == 409
    bad = admin(server, "POST", "/admin/v1/tenants", json={"id": "Bad Name"})
    assert bad.status_code == 400 and error(bad)["param"] == "id"

    rotated = admin(server, "POST", "/admin/v1/tenants/initech/keys", json={})
    new_key = rotated.json()["api_key"]
    assert call(server, key, model).status_code == 401
    assert call(server, new_key, model).status_code == 200

    assert admin(server, "DELETE", "/admin/v1/tenants/initech").status_code == 204
    assert call(server, new_key, model).status_code == 401
    assert admin(server, "GET", "/admin/v1/tenants/initech").status_code == 404


def test_access_log_has_request_id_tenant_adapter_tokens_ttft(server: LiveServer) -> None:
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": ACME_ADAPTER, "prompt": "Hello", "max_tokens": 3, "stream": True},
        headers={"Authorization": f"Bearer {ACME_KEY}", "x-request-id": "trace-abc-123"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc-123"
    generated = call(server, ACME_KEY, base_model(server)).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    time.sleep(0.5)
    lines = [json.loads(x) for x in server.log_text().splitlines() if x.startswith('{"request_id"')]
    line = next(x for x in lines if x["request_id"] == "trace-abc-123")
    assert (line["tenant"], line["adapter"], line["status"]) == ("acme", ACME_ADAPTER, 200)
    assert line["completion_tokens"] == 3 and line["prompt_tokens"] > 0
    assert line["ttft_ms"] > 0 and line["e2e_ms"] >= line["ttft_ms"]
    assert any(x["request_id"] == generated for x in lines)
    assert ACME_KEY not in server.log_text() and GLOBEX_KEY not in server.log_text()


def test_unauthorized_and_rate_limits_are_counted(server: LiveServer) -> None:
    model = base_model(server)
    assert call(server, None, model).status_code == 401
    for _ in range(3):
        call(server, LIMITED_KEY, model)
    text = httpx.get(server.base_url + "/metrics").text
    assert re.search(
        r'loraplex_rejections_total\{reason="unauthorized",tenant="unknown"\} [1-9]', text
    )
    assert re.search(
        r'loraplex_rejections_total\{reason="requests_per_minute",tenant="limited"\} [1-9]', text
    )
    assert re.search(
        r'loraplex_requests_total\{adapter="base",error_type="rate_limit_exceeded",status="429",'
        r'tenant="limited"\} [1-9]',
        text,
    )
    # The 401 reached no model: its adapter label is `none`, not the base model's.
    assert re.search(
        r'loraplex_requests_total\{adapter="none",error_type="[a-z_]+",status="401",'
        r'tenant="unknown"\} [1-9]',
        text,
    )


# --- issue 45: bounded settings, requests paid for up front, per-tenant prefix cache ----------
@pytest.mark.parametrize(
    ("body", "param", "bound"),
    [
        ({"weight": 5e-324}, "weight", "0.001"),
        ({"weight": 1e-17}, "weight", "0.001"),
        ({"quotas": {"tokens_per_minute": 10**400}}, "quotas.tokens_per_minute", "10000000000"),
    ],
)
def test_admin_api_refuses_weights_and_quotas_out_of_bounds(
    server: LiveServer, body: dict[str, Any], param: str, bound: str
) -> None:
    """Finding 2: such a tenant was created (201), and then every completion of every tenant
    was a 500. Now the admin API answers 400 naming the field and the bound, on create and on
    change, and completions go on."""
    created = admin(server, "POST", "/admin/v1/tenants", json={"id": "bounded", **body})
    assert created.status_code == 400, created.text
    assert error(created)["param"] == param and bound in error(created)["message"]
    ok = admin(server, "POST", "/admin/v1/tenants", json={"id": "bounded"})
    assert ok.status_code == 201, ok.text
    try:
        changed = admin(server, "PATCH", "/admin/v1/tenants/bounded", json=body)
        assert changed.status_code == 400, changed.text
        assert error(changed)["param"] == param and bound in error(changed)["message"]
        assert admin(server, "GET", "/admin/v1/tenants/bounded").json()["weight"] == 1.0
        assert call(server, ok.json()["api_key"], base_model(server)).status_code == 200
        assert call(server, ACME_KEY, base_model(server)).status_code == 200
    finally:
        assert admin(server, "DELETE", "/admin/v1/tenants/bounded").status_code == 204


def test_tokens_and_sequences_are_paid_for_at_admission(server: LiveServer) -> None:
    """Finding 5: at 200 tokens a minute one request was served 6,431 tokens before any 429.
    A request that reserves more than the quota holds is a 400 naming the bound; one that fits
    is served, and the next is refused until the refill, having been charged up front."""
    created = admin(
        server,
        "POST",
        "/admin/v1/tenants",
        json={"id": "metered", "quotas": {"tokens_per_minute": 200}},
    )
    assert created.status_code == 201, created.text
    key, model = created.json()["api_key"], base_model(server)
    try:
        too_large = call(server, key, model, max_tokens=400, n=2, temperature=1.0)
        assert too_large.status_code == 400, too_large.text
        body = error(too_large)
        assert (body["code"], body["param"]) == ("request_too_large", "max_tokens")
        assert "tokens_per_minute (200)" in body["message"]
        too_wide = call(server, key, model, n=3, temperature=1.0)  # max_running is 2
        assert too_wide.status_code == 400 and error(too_wide)["param"] == "n"
        assert "tenancy.max_running (2)" in error(too_wide)["message"]

        served = call(server, key, model, max_tokens=150, ignore_eos=True)
        assert served.status_code == 200, served.text
        usage = served.json()["usage"]
        refused = call(server, key, model, max_tokens=150, ignore_eos=True)
        assert refused.status_code == 429, refused.text
        assert error(refused)["code"] == "rate_limit_exceeded"
        assert usage["total_tokens"] <= 200
    finally:
        assert admin(server, "DELETE", "/admin/v1/tenants/metered").status_code == 204


def _prefix_cache_use(server: LiveServer, key: str, prompt: list[int]) -> float:
    """Prompt tokens vLLM's prefix cache served from cached blocks for one request (its own
    `vllm:prefix_cache_hits` counter: deterministic, unlike timing)."""
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    hits_before, queries_before = _metric(server, hits), _metric(server, queries)
    r = call(server, key, base_model(server), prompt=prompt, max_tokens=1)
    assert r.status_code == 200, r.text
    wait_until(lambda: _metric(server, queries) - queries_before >= len(prompt), 30)
    return _metric(server, hits) - hits_before


def test_prefix_cache_is_shared_within_a_tenant_and_a_group_never_across(
    server: LiveServer,
) -> None:
    """Finding 4: a prompt matching another tenant's hit its cached blocks (first token in 0.3 s
    instead of 2.75 s). Every request now carries its tenant's cache salt: the same prompt of
    600 tokens hits the cache on its tenant's second request and within the sharing group
    `partners` (tenancy.share_prefix_cache), never from another tenant."""
    partners = {}
    for tenant in ("partner-a", "partner-b"):
        r = admin(server, "POST", "/admin/v1/tenants", json={"id": tenant})
        assert r.status_code == 201, r.text
        partners[tenant] = r.json()["api_key"]
    try:
        nonce = [int(uuid.uuid4().int % 40000) + 1000 for _ in range(4)]
        prompt = nonce + list(range(2000, 2596))  # earlier runs cached nothing of it
        assert _prefix_cache_use(server, ACME_KEY, prompt) == 0
        assert _prefix_cache_use(server, GLOBEX_KEY, prompt) == 0  # acme's blocks: not globex's
        assert _prefix_cache_use(server, partners["partner-a"], prompt) == 0
        assert _prefix_cache_use(server, ACME_KEY, prompt) >= len(prompt) // 2
        assert _prefix_cache_use(server, partners["partner-b"], prompt) >= len(prompt) // 2
        assert _prefix_cache_use(server, GLOBEX_KEY, prompt) >= len(prompt) // 2
    finally:
        for tenant in partners:
            assert admin(server, "DELETE", f"/admin/v1/tenants/{tenant}").status_code == 204


def test_a_client_cannot_set_the_cache_salt(server: LiveServer) -> None:
    r = call(server, GLOBEX_KEY, base_model(server), cache_salt="acme")
    assert r.status_code == 400 and error(r)["param"] == "cache_salt"
