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


@pytest.mark.parametrize(
    ("key", "instead"),
    [("max_loras", "engine.max_loras"), ("enable-lora", "loraplex always enables LoRA"),
     ("--max-cpu-loras", "engine.max_cpu_loras"), ("max_lora_rank", "engine.max_lora_rank"),
     ("scheduling_policy", "tenancy.engine_priority"),
     ("scheduler_cls", "engine.paced_prefill_tokens"), ("port", "http.port")],
)  # fmt: skip
def test_vllm_args_loraplex_owns_are_refused_naming_the_setting_to_use(
    key: str, instead: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(engine={"vllm_args": {key: 1}})
    name = key.lstrip("-").replace("-", "_")
    assert f"engine.vllm_args.{name}: loraplex sets this vLLM argument itself" in str(e.value)
    assert instead in str(e.value)


def test_vllm_args_that_are_loraplex_settings_fold_into_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAPLEX_ENGINE__VLLM_ARGS", '{"max-num-seqs": 8, "kv_cache_dtype": "fp8"}')
    engine = load_settings().engine
    assert engine.max_num_seqs == 8 and engine.vllm_args == {"kv_cache_dtype": "fp8"}
    with pytest.raises(ConfigError) as e:
        load_settings(engine={"max_num_seqs": 4})
    assert "engine.max_num_seqs (4) and engine.vllm_args.max_num_seqs (8) disagree" in str(e.value)
    # The folded value meets the setting's own checks.
    monkeypatch.setenv("LORAPLEX_ENGINE__VLLM_ARGS", '{"max_num_seqs": 0}')
    with pytest.raises(ConfigError, match=r"engine\.max_num_seqs: Input should be greater than"):
        load_settings()


@pytest.mark.parametrize(
    ("vllm_args", "said"),
    [({"kv_cache_dtype": "fp9"},
      "engine.vllm_args.kv_cache_dtype: vLLM {v} says: argument --kv-cache-dtype: invalid choice: "
      "'fp9' (choose from 'auto'"),
     ({"tensor_parallel_size": "two"},
      "engine.vllm_args.tensor_parallel_size: vLLM {v} says: argument --tensor-parallel-size"),
     ({"enable_prefix_cachng": True},
      "engine.vllm_args.enable_prefix_cachng: not an argument of vLLM {v}'s engine or OpenAI "
      "serving layer (did you mean enable_prefix_caching?)"),
     ({"enable_prefix_caching": "maybe"},
      "engine.vllm_args.enable_prefix_caching: expects true or false (got 'maybe')"),
     ({"root_path": "/v"},
      "engine.vllm_args.root_path: an argument of `vllm serve`'s HTTP server; loraplex serves "
      "HTTP itself")],
    ids=["bad-choice", "bad-int", "misspelt", "bad-switch", "http-server"],
)  # fmt: skip
def test_vllm_args_are_checked_by_vllms_own_parser(vllm_args: dict, said: str) -> None:
    import vllm

    from loraplex.server.engine.builder import parse_vllm_args

    with pytest.raises(ConfigError) as e:
        parse_vllm_args(load_settings(engine={"vllm_args": vllm_args}).engine)
    assert said.format(v=vllm.__version__) in str(e.value)


def test_vllm_args_reach_vllms_engine_arguments_beside_loraplexs_own(tmp_path: Path) -> None:
    from loraplex.kernels.vllm.plugin import COMPILE_CACHE_KEY
    from loraplex.server.engine.builder import engine_args, vllm_namespace

    args = {"enable_prefix_caching": True, "kv-cache-dtype": "fp8", "tensor_parallel_size": 2,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
            "additional_config": {"mine": 1}, "tool_call_parser": "hermes"}  # fmt: skip
    settings = load_settings(engine={"vllm_args": args}).engine
    namespace = vllm_namespace(settings, tmp_path, "served")
    built = engine_args(settings, namespace)
    assert built.enable_prefix_caching is True and built.kv_cache_dtype == "fp8"
    assert built.tensor_parallel_size == 2 and built.speculative_config["method"] == "ngram"
    assert built.enable_lora is True and built.max_loras == settings.max_loras
    assert built.model == str(tmp_path) and built.served_model_name == ["served"]
    assert built.additional_config == {"mine": 1, COMPILE_CACHE_KEY: "on"}
    assert namespace.tool_call_parser == "hermes"  # a serving-layer argument, for vLLM's server


def test_vllm_serves_own_cross_argument_checks_run_at_start(tmp_path: Path) -> None:
    from loraplex.server.engine.builder import vllm_namespace

    settings = load_settings(engine={"vllm_args": {"chat_template": str(tmp_path / "none")}}).engine
    with pytest.raises(ConfigError, match=r"engine\.vllm_args: "):
        vllm_namespace(settings, tmp_path, "served")


def test_serve_refuses_a_bad_vllm_arg_before_the_engine_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loraplex.server.cli import main

    assert main(["serve", "--vllm-arg", "kv_cache_dtype=fp9"]) == 2
    assert "engine.vllm_args.kv_cache_dtype: vLLM" in capsys.readouterr().err
    assert main(["serve", "--vllm-arg", "max_loras=8"]) == 2
    assert "use engine.max_loras" in capsys.readouterr().err
    assert main(["serve", "--vllm-arg", "enable_prefix_caching"]) == 2
    assert "--vllm-arg 'enable_prefix_caching': expected KEY=VALUE" in capsys.readouterr().err


def test_the_plugin_says_which_setting_hands_layers_back_to_vllms_kernels() -> None:
    from loraplex.server.engine.builder import kernel_handbacks

    settings = load_settings(
        engine={"max_lora_rank": 256, "vllm_args": {"fully_sharded_loras": True,
                                                    "enable_expert_parallel": "true"}}
    ).engine  # fmt: skip
    said = "\n".join(kernel_handbacks(settings))
    assert "engine.vllm_args.fully_sharded_loras" in said and "collective" in said
    assert "engine.vllm_args.enable_expert_parallel" in said
    assert "engine.max_lora_rank (256): ranks over 128" in said
    off = load_settings(engine={"moe_lora_kernels": False, "max_lora_rank": 256}).engine
    assert kernel_handbacks(off) == []


def test_parsers_and_the_generation_config_are_settings_vllm_checks() -> None:
    from loraplex.server.engine.builder import vllm_namespace

    settings = load_settings(
        engine={"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                "vllm_args": {"reasoning-parser": "deepseek_r1", "generation_config": "vllm"}}
    ).engine  # fmt: skip
    assert settings.reasoning_parser == "deepseek_r1" and settings.generation_config == "vllm"
    namespace = vllm_namespace(settings, Path("/m"), "m")
    assert namespace.tool_call_parser == "hermes" and namespace.enable_auto_tool_choice is True
    assert namespace.reasoning_parser == "deepseek_r1" and namespace.generation_config == "vllm"
    for field in ("tool_call_parser", "reasoning_parser"):
        with pytest.raises(ConfigError) as e:
            vllm_namespace(load_settings(engine={field: "nope"}).engine, Path("/m"), "m")
        assert f"engine.{field}: vLLM" in str(e.value) and "no parser 'nope' (it has " in str(
            e.value
        )
