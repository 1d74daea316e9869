"""Which adapter modules an engine started with `lora_target_modules` applies LoRA to.

vLLM wraps a model's module with LoRA only if `vllm.lora.utils.is_in_target_modules` passes it
(`LoRAModelManager._match_target_modules`, 0.26 and 0.32 alike), on the module's runtime name:
`qkv_proj` where an adapter has `q_proj`, `k_proj` or `v_proj` (the model class's
`packed_modules_mapping`), the whole `experts` group where it has one expert's projection or the
fused `experts` / `experts.base_layer` parameters. Its adapter loader checks the adapter's
modules against every module the model supports, so LoRA on a module left unwrapped loads and is
never applied. `lora_targets` gives the registry that rule (`adapters_registry.engine.LoraTargets`)
so registration refuses such an adapter; the rule is vLLM's own function, called here, where vLLM
may be imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from loraplex.adapters_registry.engine import LoraTargets

_EXPERTS = "experts"


def runtime_module(module: str, packed: Mapping[str, Sequence[str]]) -> str:
    """The module vLLM wraps to apply the LoRA an adapter gives for `module`:
    `...mlp.experts.3.gate_proj`, `...mlp.experts.base_layer` -> `...mlp.experts`;
    `...self_attn.k_proj` -> `...self_attn.qkv_proj` when `packed` has qkv_proj: [q, k, v]."""
    parts = module.split(".")
    if _EXPERTS in parts:
        return ".".join(parts[: parts.index(_EXPERTS) + 1])
    parent = next((p for p, children in packed.items() if parts[-1] in children), None)
    return ".".join([*parts[:-1], parent]) if parent is not None else module


def applies_lora(
    module: str, targets: Sequence[str] | None, packed: Mapping[str, Sequence[str]]
) -> bool:
    """Whether an engine restricted to `targets` applies the LoRA an adapter gives for `module`
    (named as the adapter names it), by vLLM's `is_in_target_modules` on the runtime module.

    The adapter's own name is also asked, so that a mapping this side gets wrong (a model that
    packs more at run time than its class says) never refuses what vLLM would serve; not for
    expert modules: vLLM never asks about one expert's projection, only about the group, and
    `gate_proj` in the list leaves the experts unwrapped.
    """
    from vllm.lora.utils import is_in_target_modules

    target_list = None if targets is None else list(targets)
    packed_dict = {p: list(children) for p, children in packed.items()}
    runtime = runtime_module(module, packed)
    if is_in_target_modules(runtime, target_list, packed_dict):
        return True
    is_expert = _EXPERTS in module.split(".")
    return not is_expert and is_in_target_modules(module, target_list, packed_dict)


def packed_modules_mapping(model_config: Any) -> dict[str, list[str]]:
    """The served model class's `packed_modules_mapping` (`qkv_proj: [q_proj, k_proj, v_proj]`),
    by vLLM's own model resolution (`get_model_cls`, 0.26 and 0.32)."""
    from vllm.model_executor.model_loader.utils import get_model_cls

    mapping = getattr(get_model_cls(model_config), "packed_modules_mapping", None) or {}
    return {parent: list(children) for parent, children in mapping.items()}


def lora_targets(vllm_config: Any) -> LoraTargets | None:
    """The started engine's restriction (`vllm_config.lora_config.target_modules`, as vLLM
    parsed `--lora-target-modules`) for the registry; None when it has none."""
    targets = vllm_config.lora_config.target_modules
    if targets is None:
        return None
    packed = packed_modules_mapping(vllm_config.model_config)
    return LoraTargets(tuple(targets), partial(applies_lora, targets=tuple(targets), packed=packed))
