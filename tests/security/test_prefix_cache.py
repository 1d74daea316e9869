"""Issue 45, finding 4 (first half), re-run on the shared server: the prefix cache is per tenant.

Before, a prompt matching another tenant's hit that tenant's cached blocks (`vllm:prefix_cache_hits`
rose; first token in 0.3 s instead of 2.75 s), which told mallory what bob had sent. Every engine
request now carries its tenant's cache salt. Measured with vLLM's own counters, not timing.
"""

from __future__ import annotations

import uuid

from bench.loadgen.polling import wait_until
from bench.loadgen.server import LiveServer
from tests.support.bystanders import (
    BOB_KEY,
    MALLORY_KEY,
    Bystanders,
    as_tenant,
    base_model,
    metrics_text,
)

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def _counter(server: LiveServer, name: str) -> float:
    text = metrics_text(server)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _cached_tokens(server: LiveServer, key: str, prompt: list[int]) -> float:
    """Prompt tokens the prefix cache served for one request of `key`'s tenant."""
    hits, queries = _counter(server, HITS), _counter(server, QUERIES)
    body = {"model": base_model(server), "prompt": prompt, "max_tokens": 1}
    r = as_tenant(server, key, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert wait_until(lambda: _counter(server, QUERIES) - queries >= len(prompt), 30)
    return _counter(server, HITS) - hits


def test_another_tenants_prompt_never_hits_its_cached_blocks(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    nonce = [1000 + uuid.uuid4().int % 40000 for _ in range(4)]  # nothing of it cached yet
    bobs_prompt = nonce + list(range(3000, 3596))
    assert _cached_tokens(shared_server, BOB_KEY, bobs_prompt) == 0
    assert _cached_tokens(shared_server, MALLORY_KEY, bobs_prompt) == 0
    assert _cached_tokens(shared_server, MALLORY_KEY, bobs_prompt) >= len(bobs_prompt) // 2
    assert _cached_tokens(shared_server, BOB_KEY, bobs_prompt) >= len(bobs_prompt) // 2
    bystanders.assert_unchanged()


def test_a_client_cannot_choose_its_cache_salt(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    body = {"model": base_model(shared_server), "prompt": "Hi", "max_tokens": 1,
            "cache_salt": "bob"}  # fmt: skip
    r = as_tenant(shared_server, MALLORY_KEY, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    bystanders.assert_unchanged()
