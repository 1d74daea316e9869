"""The engine wrapper never binds one engine id to two adapter versions (vLLM would keep serving
the first version's weights under the second's name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapters_registry.base import ServableAdapter
from loraplex.server.engine.client import EngineClient, EngineIdConflict


def _client() -> EngineClient:
    return EngineClient(engine=None, tokenizer=None, max_model_len=2048)  # type: ignore[arg-type]


def test_same_version_may_reuse_its_id() -> None:
    client = _client()
    v1 = ServableAdapter("acme/bot", "aaa", engine_id=7, path=Path("/cache/aaa"), rank=8)
    first = client.lora_request(v1)
    again = client.lora_request(v1)
    assert first.lora_int_id == again.lora_int_id == 7
    assert first.lora_name == "acme/bot@aaa" and first.lora_path == "/cache/aaa"


def test_other_version_under_a_bound_id_is_refused() -> None:
    client = _client()
    client.lora_request(ServableAdapter("acme/bot", "aaa", 7, Path("/cache/aaa"), 8))
    with pytest.raises(EngineIdConflict, match="engine id 7 is bound to acme/bot@aaa"):
        client.lora_request(ServableAdapter("acme/bot", "bbb", 7, Path("/cache/bbb"), 8))
    with pytest.raises(EngineIdConflict):
        client.lora_request(ServableAdapter("other", "aaa", 7, Path("/elsewhere"), 8))
