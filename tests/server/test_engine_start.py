"""`loraplex serve` builds its engine as `vllm serve` does, so that vLLM's defaults for what the
settings leave unset are those of vLLM's own server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from loraplex.server.engine.builder import CPU_KV_CACHE_ENV, MOE_LORA_KERNELS_ENV
from loraplex.server.engine.client import EngineClient
from loraplex.server.settings import load_settings


class _Built(Exception):
    """Stops the start where vLLM would build the engine."""


def test_the_engine_is_built_in_vllm_serves_usage_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM sizes an unset step budget by the usage context: on an H100 or H200, 8,192 tokens for
    its server and 2,048 for AsyncLLM's default context, which left loraplex prefilling 16
    prompts of 1,600 tokens in four times the steps."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    seen: dict[str, Any] = {}

    def build(engine_args: Any, **kwargs: Any) -> None:
        seen.update(kwargs, engine_args=engine_args)
        raise _Built

    monkeypatch.setattr(AsyncLLM, "from_engine_args", build)
    for name in (CPU_KV_CACHE_ENV, MOE_LORA_KERNELS_ENV):  # the start exports them
        monkeypatch.setenv(name, "0")
    settings = load_settings().engine
    with pytest.raises(_Built):
        asyncio.run(EngineClient.start(settings, tmp_path, "served"))
    assert seen["usage_context"] is UsageContext.OPENAI_API_SERVER
    assert seen["engine_args"].max_num_batched_tokens is None  # left to vLLM's default
