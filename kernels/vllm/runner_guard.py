"""The plugin hands back to vLLM's own LoRA kernels in a GPU worker that runs vLLM's V2 model
runner (vLLM 0.26: dense models by default; MoE models run on V1).

Our kernels and their warm-up were built and measured on the V1 runner only. On the H200 a dense
Qwen3 on V2 with them failed to start: an illegal memory access in the LoRA warm-up's first
step, then in every CUDA call after it; vLLM's own kernels on the same engine served
(docs/kernels.md, "The V2 model runner"). V2 takes the warm-up's V1 arguments into `**kwargs`
and drops them, so its dummy steps are not the ones the warm-up asks for.

The runner kind is known only in the worker, once vLLM has built its config: `register()` runs
before that (vLLM calls it with no arguments). So `register()` patches as before, saving vLLM's
attributes first (`Originals`), and `install` wraps `Worker.init_device`, which builds the model
runner: there, before any model or LoRA state exists, `hand_back` decides and puts vLLM's
attributes back, logging which setting made it and why.
"""

from __future__ import annotations

import enum
import functools
import os
from typing import Any

from loraplex.kernels.vllm.plugin import log

V2_SETTING = "VLLM_USE_V2_MODEL_RUNNER"
_MISSING = object()


class HandBack(enum.Enum):
    NONE = "none"  # the V1 runner: our kernels serve
    ALL = "all"  # the V2 runner: vLLM's kernels, warm-up and batch metadata
    KERNELS = "kernels"  # V2 under specialize_active_lora: vLLM's kernels, our batch metadata


def hand_back(use_v2_model_runner: bool, specialize_active_lora: bool) -> HandBack:
    """What goes back to vLLM in a worker on this runner. Under specialize_active_lora our batch
    metadata stays: vLLM's own drops an adapter's delta beside base-model requests in that mode
    (`batch_metadata.fill_kernel_meta`), and it writes only the tensors vLLM's kernels read."""
    if not use_v2_model_runner:
        return HandBack.NONE
    return HandBack.KERNELS if specialize_active_lora else HandBack.ALL


def which_setting(env_value: str | None) -> str:
    """The setting that put this worker on the V2 runner: the environment variable where set,
    else vLLM's default for the model."""
    if env_value is not None:
        return f"{V2_SETTING}={env_value}"
    return f"vLLM's default for this model ({V2_SETTING} unset: V2 for models without experts)"


class Originals:
    """vLLM attributes as they were before the plugin replaced them, to put back. Read from the
    owner's own namespace, so a descriptor comes back as it was and an inherited attribute is
    deleted again rather than copied onto the subclass."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def save(self, owner: Any, *names: str) -> Originals:
        for name in names:
            self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
        return self

    def restore(self) -> None:
        for owner, name, value in reversed(self._saved):
            if value is _MISSING:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


def apply(worker: Any, kernels: Originals, metadata: Originals, env_value: str | None) -> HandBack:
    """Decide for this worker (`hand_back`), put back what goes to vLLM, log it."""
    lora_config = worker.vllm_config.lora_config
    specialize = bool(lora_config is not None and lora_config.specialize_active_lora)
    decision = hand_back(bool(worker.use_v2_model_runner), specialize)
    if decision is HandBack.NONE:
        return decision
    kernels.restore()
    if decision is HandBack.ALL:
        metadata.restore()
    kept = (
        "; loraplex's LoRA batch metadata stays (engine.specialize_active_lora needs it)"
        if decision is HandBack.KERNELS
        else ""
    )
    log.warning("loraplex MoE-LoRA kernels: handed back to vLLM's own LoRA kernels in this "
                "worker (pid %d): it runs vLLM's V2 model runner (%s), and loraplex's kernels "
                "and LoRA warm-up are built for the V1 runner (a dense model on V2 crashed at "
                "start with them; docs/kernels.md); %s=0 puts the model on the V1 runner%s",
                os.getpid(), which_setting(env_value), V2_SETTING, kept)  # fmt: skip
    return decision


def install(worker_cls: type, kernels: Originals, metadata: Originals) -> None:
    """Run `apply` at the start of `worker_cls.init_device` (vLLM's GPU Worker), before it
    builds the model runner. Installed again, it wraps vLLM's method, not its own wrapper."""
    original = worker_cls.init_device  # type: ignore[attr-defined]
    original = getattr(original, "_loraplex_wraps", original)

    @functools.wraps(original)
    def init_device(self: Any) -> Any:
        apply(self, kernels, metadata, os.environ.get(V2_SETTING))
        return original(self)

    init_device._loraplex_wraps = original  # type: ignore[attr-defined]
    worker_cls.init_device = init_device  # type: ignore[attr-defined]
