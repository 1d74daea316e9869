"""Settings are validated once at start, with messages that name the field and the bound."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loraplex.server.settings import CONFIG_FILE_ENV, ConfigError, EngineSettings, load_settings


def test_defaults_are_valid() -> None:
    settings = load_settings()
    assert settings.engine.max_cpu_loras >= settings.engine.max_loras
    assert settings.engine.model is None  # the embedded default


def test_cross_field_error_prints_both_values() -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(engine={"max_loras": 8, "max_cpu_loras": 4})
    assert "engine.max_cpu_loras (4) must be >= engine.max_loras (8)" in str(e.value)


def test_bound_violation_names_field_and_bound() -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(engine={"max_num_seqs": 0})
    message = str(e.value)
    assert "engine.max_num_seqs" in message and "greater than or equal to 1" in message


@pytest.mark.parametrize(
    ("engine", "named"),
    [({"max_lora_rank": 24}, "engine.max_lora_rank"),
     ({"max_num_seqs": 64, "max_num_batched_tokens": 32},
      "engine.max_num_batched_tokens (32) must be >= engine.max_num_seqs (64)")],
    ids=["rank-vllm-refuses", "step-budget-below-seqs"],
)  # fmt: skip
def test_engine_values_vllm_refuses_at_start_are_refused_in_the_settings(
    engine: dict, named: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_settings(engine=engine)


@pytest.mark.parametrize(
    ("tenancy", "named"),
    [
        ({"tenants": [{"id": "a", "api_keys": ["short-secret"]}]}, "at least 16 characters"),
        (
            {"tenants": [{"id": "a", "api_keys": ["shared-secret-0123456789"]},
                         {"id": "b", "api_keys": ["shared-secret-0123456789"]}]},
            "the same api key is given to two tenants",
        ),
    ],
    ids=["short-key", "key-given-twice"],
)  # fmt: skip
def test_config_errors_never_print_api_keys(tenancy: dict, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(tenancy=tenancy)
    message = str(e.value)
    assert named in message and "secret" not in message


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"http": {"admin_token": ["not-a-string-secret"]}}, "http.admin_token"),
        ({"http": {"admin-token": "misspelt-secret-0123456789"}}, "http.admin-token"),
        ({"tenancy": {"tenants": [{"id": "a", "api_key": "misspelt-secret-0123456789"}]}},
         "tenancy.tenants.0.api_key"),
    ],
    ids=["wrong-type", "misspelt-token", "misspelt-key"],
)  # fmt: skip
def test_config_errors_never_print_the_admin_token_or_a_misspelt_secret(
    section: dict, named: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(**section)
    assert named in str(e.value) and "secret" not in str(e.value)


def test_a_bad_token_count_still_shows_its_value() -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(tenancy={"tenants": [{"id": "a", "quotas": {"tokens_per_minute": -5}}]})
    assert "tokens_per_minute" in str(e.value) and "(got -5)" in str(e.value)


def test_largest_adapter_must_fit_the_disk_cache() -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(registry={"disk_cache_gib": 1, "max_adapter_mib": 2048})
    message = str(e.value)
    assert "registry.max_adapter_mib (2048 MiB) must fit in registry.disk_cache_gib (1" in message


def test_environment_variables_fill_nested_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_ENGINE__MAX_LORAS", "3")
    monkeypatch.setenv("LORAPLEX_HTTP__PORT", "9001")
    settings = load_settings()
    assert settings.engine.max_loras == 3 and settings.http.port == 9001


def test_a_lora_rank_from_an_environment_variable_is_read_as_a_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAPLEX_ENGINE__MAX_LORA_RANK", "32")
    assert load_settings().engine.max_lora_rank == 32


@pytest.mark.parametrize("off", ["none", "None", "null"])
def test_paced_prefill_turns_off_from_an_environment_variable(
    monkeypatch: pytest.MonkeyPatch, off: str
) -> None:
    monkeypatch.setenv("LORAPLEX_ENGINE__PACED_PREFILL_TOKENS", off)
    assert load_settings().engine.paced_prefill_tokens is None
    monkeypatch.setenv("LORAPLEX_ENGINE__PACED_PREFILL_TOKENS", "32")
    assert load_settings().engine.paced_prefill_tokens == 32


def test_environment_variable_with_bad_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_HTTP__PORT", "70000")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert "http.port" in str(e.value) and "65535" in str(e.value)


def test_config_file_and_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "loraplex.yaml"
    config.write_text("engine:\n  max_loras: 2\n  max_model_len: 1024\nhttp:\n  port: 8100\n")
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))
    monkeypatch.setenv("LORAPLEX_HTTP__PORT", "8200")
    settings = load_settings()
    assert settings.engine.max_loras == 2 and settings.engine.max_model_len == 1024
    assert settings.http.port == 8200  # the environment beats the file


def test_unknown_key_in_config_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "loraplex.yaml"
    config.write_text("engine:\n  max_lorass: 2\n")
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert "engine.max_lorass" in str(e.value)


def test_missing_config_file_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_FILE_ENV, "/nonexistent/loraplex.yaml")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert CONFIG_FILE_ENV in str(e.value)


def test_load_format_names_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(engine={"load_format": "pt"})
    assert "engine.load_format" in str(err.value) and "'auto' or 'dummy'" in str(err.value)


def test_paced_prefill_chunk_is_bounded_by_the_context() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(engine={"paced_prefill_tokens": 4096, "max_model_len": 2048})
    assert "engine.paced_prefill_tokens (4096) must be <= engine.max_model_len (2048)" in str(
        err.value
    )


def test_specialize_active_lora_reaches_vllms_engine_args(tmp_path: Path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from loraplex.server.engine.builder import engine_kwargs

    for on in (False, True):
        settings = EngineSettings.model_validate({"specialize_active_lora": on})
        assert (
            AsyncEngineArgs(**engine_kwargs(settings, tmp_path, "m")).specialize_active_lora is on
        )


def test_graphs_per_adapter_count_need_the_plugins_batch_metadata() -> None:
    with pytest.raises(ValueError) as err:
        EngineSettings.model_validate({"specialize_active_lora": True, "moe_lora_kernels": False})
    assert "engine.specialize_active_lora (True) needs engine.moe_lora_kernels (False) on" in str(
        err.value
    )
    EngineSettings.model_validate({"specialize_active_lora": True, "moe_lora_kernels": True})


def test_graphs_per_adapter_count_need_the_vllm_the_plugin_patches() -> None:
    """On a GPU engine whose vLLM the plugin does not patch, vLLM's own batch metadata would
    serve the per-count graphs: refused, naming the setting and both versions."""
    from loraplex.server.engine.builder import check_specialized_graphs
    from loraplex.server.settings import ConfigError

    on = EngineSettings.model_validate({"specialize_active_lora": True})
    with pytest.raises(ConfigError) as err:
        check_specialized_graphs(on, "0.27.1", cpu=False)
    assert "engine.specialize_active_lora (True) needs vLLM 0.26.x" in str(err.value)
    assert "found vLLM 0.27.1" in str(err.value)
    check_specialized_graphs(on, "0.26.0", cpu=False)
    check_specialized_graphs(on, "0.32.0", cpu=True)  # CPU engines do not use that metadata
    check_specialized_graphs(EngineSettings(), "0.27.1", cpu=False)
