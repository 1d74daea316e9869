"""Checking an adapter against the served base model before anything serves it.

vLLM accepts adapters that then silently serve (part of) the base model: a target module the
model does not have is skipped, a tensor of the wrong shape fails only at load inside the engine.
Here every field and every tensor is checked up front; the first problem raises AdapterInvalid
naming the field or tensor, the bound, and a fixed `reason` label for metrics.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters_registry.base import AdapterInvalid
from loraplex.adapters_registry.base_model import BaseModelSpec
from loraplex.adapters_registry.tensors import HeaderError, TensorInfo, read_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_PREFIX = "base_model.model."
# Inits that only set starting weights, so the saved adapter is a plain LoRA (vLLM's list).
_PLAIN_INITS = {"gaussian", "eva", "orthogonal", "mica", "lora_ga"}


@dataclass(frozen=True)
class ValidatedAdapter:
    rank: int
    modules: int


def invalid(reason: str, message: str, param: str) -> AdapterInvalid:
    return AdapterInvalid(message, param=param, reason=reason)


def check_listing(files: Mapping[str, int], max_bytes: int) -> None:
    """Given the source's file names -> sizes, refuse missing, pickle-only or oversized adapters."""
    if CONFIG_FILE not in files:
        raise invalid("missing_config", f"the source holds no {CONFIG_FILE}", CONFIG_FILE)
    if WEIGHTS_FILE not in files:
        pickles = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise invalid(
                "pickle",
                f"{pickles[0]} is a pickle file, which can run code when loaded; only "
                f"{WEIGHTS_FILE} is accepted (convert with safetensors.torch.save_file)",
                WEIGHTS_FILE,
            )
        raise invalid("missing_weights", f"the source holds no {WEIGHTS_FILE}", WEIGHTS_FILE)
    size = files[CONFIG_FILE] + files[WEIGHTS_FILE]
    if size > max_bytes:
        raise invalid(
            "size",
            f"adapter is {size} bytes; registry.max_adapter_mib allows at most {max_bytes}",
            WEIGHTS_FILE,
        )


def _load_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError as e:
        raise invalid("missing_config", f"{CONFIG_FILE} is missing", CONFIG_FILE) from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid("bad_config", f"{CONFIG_FILE} is not valid JSON: {e}", CONFIG_FILE) from e
    if not isinstance(config, dict):
        raise invalid("bad_config", f"{CONFIG_FILE} is not a JSON object", CONFIG_FILE)
    return config


def _check_features(config: dict[str, Any]) -> None:
    refused = {
        "use_dora": "DoRA (use_dora) is not supported by vLLM",
        "lora_bias": "LoRA bias (lora_bias) is not supported by vLLM",
        "modules_to_save": "modules_to_save (fully trained modules) is not supported by vLLM",
        "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens) is not supported",
        "layer_replication": "layer_replication is not supported by vLLM",
        "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported by vLLM",
        "use_qalora": "QALoRA (use_qalora) is not supported by vLLM",
    }
    for key, why in refused.items():
        if config.get(key):
            raise invalid("unsupported_feature", f"{CONFIG_FILE}: {key}: {why}", key)
    if config.get("bias", "none") != "none":
        raise invalid(
            "unsupported_feature",
            f"{CONFIG_FILE}: bias is {config['bias']!r}; vLLM supports only 'none'",
            "bias",
        )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        raise invalid(
            "unsupported_feature",
            f"{CONFIG_FILE}: init_lora_weights {init!r} modifies the base weights; convert the "
            "adapter to a plain LoRA first",
            "init_lora_weights",
        )


def _check_rank(config: dict[str, Any], max_lora_rank: int) -> dict[str, int]:
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise invalid("bad_config", f"{CONFIG_FILE}: r must be a positive integer, got {r!r}", "r")
    if r > max_lora_rank:
        raise invalid("rank", f"rank r={r} exceeds max_lora_rank={max_lora_rank}", "r")
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: rank_pattern must be an object", "rank_pattern"
        )
    for key, value in pattern.items():
        if not isinstance(value, int) or value < 1 or value > max_lora_rank:
            raise invalid(
                "rank",
                f"rank_pattern[{key!r}]={value!r} must be an integer in 1..{max_lora_rank} "
                "(max_lora_rank)",
                "rank_pattern",
            )
    return {"": r, **pattern}


def _rank_for(ranks: dict[str, int], module: str) -> int:
    # vLLM's (and PEFT's) rule: the first pattern that is a '.'-bounded suffix of the name wins.
    for key, value in ranks.items():
        if key and re.match(rf"(.*\.)?({key})$", module):
            return value
    return ranks[""]


def _check_targets(config: dict[str, Any], spec: BaseModelSpec) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets != "all-linear" and not any(re.fullmatch(targets, m) for m in spec.linear):
            raise invalid(
                "target_modules",
                f"target_modules regex {targets!r} matches no linear module of {spec.name}",
                "target_modules",
            )
    elif isinstance(targets, list):
        for target in targets:
            if not isinstance(target, str) or not spec.matches_target(target):
                raise invalid(
                    "target_modules",
                    f"target module {target!r} is not a linear module of {spec.name} that can "
                    "take LoRA (only decoder-layer linears can)",
                    "target_modules",
                )
    elif targets is not None or not config.get("target_parameters"):
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: target_modules must be a list or a regex string",
            "target_modules",
        )  # fmt: skip
    for param in config.get("target_parameters") or []:
        if spec.moe is None or param.rsplit(".", 1)[-1] not in ("gate_up_proj", "down_proj"):
            raise invalid(
                "target_modules",
                f"target parameter {param!r}: {spec.name} has no fused MoE expert parameter "
                "of that name (supported: experts.gate_up_proj, experts.down_proj)",
                "target_parameters",
            )


def _split_tensor_name(name: str) -> tuple[str, str]:
    """`base_model.model.M.lora_A.weight` -> (M, "A"); refuses anything else, naming it."""
    if "lora_magnitude_vector" in name:
        raise invalid("unsupported_feature", f"tensor `{name}` is a DoRA magnitude", name)
    if "lora_embedding_" in name:
        raise invalid("unsupported_feature", f"tensor `{name}`: LoRA on embeddings", name)
    for side in ("A", "B"):
        suffix = f".lora_{side}.weight"
        if name.startswith(_PREFIX) and name.endswith(suffix):
            return name[len(_PREFIX) : -len(suffix)], side
    raise invalid(
        "tensor_name", f"tensor `{name}` is not a LoRA weight (base_model.model.<module>."
        "lora_A.weight or .lora_B.weight)", name,
    )  # fmt: skip


def _fused_expert(module: str, spec: BaseModelSpec) -> tuple[str, str] | None:
    """PEFT names a fused-expert LoRA (`target_parameters`) `<group>.base_layer` for gate_up_proj
    and `<group>` for down_proj, group being e.g. `model.layers.0.mlp.experts`."""
    if module.endswith(".experts.base_layer"):
        group, param = module.removesuffix(".base_layer"), "gate_up_proj"
    elif module.endswith(".experts"):
        group, param = module, "down_proj"
    else:
        return None
    return (group, param) if spec.moe is not None and group in spec.expert_groups else None


def _expected_shape(
    module: str, side: str, ranks: dict[str, int], spec: BaseModelSpec
) -> tuple[int, int]:
    """(rows, cols) the LoRA factor for `module` must have on `spec`; raises if no such module."""
    fused = _fused_expert(module, spec)
    if fused is not None and spec.moe is not None:
        group, param = fused
        moe = spec.moe
        # The 3D layout stacks the experts' rank-r factors: (r * E, in) and (out, r * E).
        er = _rank_for(ranks, f"{group}.{param}") * moe.num_experts
        if param == "gate_up_proj":
            in_f, out_f = moe.hidden, 2 * moe.intermediate
        else:
            in_f, out_f = moe.intermediate, moe.hidden
        return (er, in_f) if side == "A" else (out_f, er)
    if module not in spec.linear:
        raise invalid(
            "tensor_name",
            f"module `{module}` does not exist in {spec.name} or cannot take LoRA",
            module,
        )
    out_f, in_f = spec.linear[module]
    rank = _rank_for(ranks, module)
    return (rank, in_f) if side == "A" else (out_f, rank)


def _check_tensors(
    tensors: dict[str, TensorInfo], ranks: dict[str, int], spec: BaseModelSpec, dtypes: set[str]
) -> int:
    if not tensors:
        raise invalid("missing_weights", f"{WEIGHTS_FILE} holds no tensors", WEIGHTS_FILE)
    sides: dict[str, set[str]] = {}
    for name, info in tensors.items():
        module, side = _split_tensor_name(name)
        if info.dtype not in dtypes:
            raise invalid(
                "dtype", f"tensor `{name}` is {info.dtype}; allowed: {sorted(dtypes)}", name
            )
        expected = _expected_shape(module, side, ranks, spec)
        if info.shape != expected:
            raise invalid(
                "tensor_shape",
                f"tensor `{name}` has shape {list(info.shape)}; {spec.name} needs "
                f"{list(expected)} for lora_{side} of `{module}`",
                name,
            )
        sides.setdefault(module, set()).add(side)
    for module, seen in sides.items():
        if seen != {"A", "B"}:
            missing = "B" if "A" in seen else "A"
            raise invalid("tensor_name", f"module `{module}` has no lora_{missing}", module)
    return len(sides)


def validate_adapter(
    folder: Path, spec: BaseModelSpec, *, max_lora_rank: int, allowed_dtypes: set[str]
) -> ValidatedAdapter:
    """Check `folder` (adapter_config.json + adapter_model.safetensors) against `spec`.

    Blocking (reads the header of the weights file). Raises AdapterInvalid; mutates nothing.
    """
    config = _load_config(folder)
    if config.get("peft_type") != "LORA":
        raise invalid(
            "not_lora", f"peft_type is {config.get('peft_type')!r}; only 'LORA' is served",
            "peft_type",
        )  # fmt: skip
    _check_features(config)
    ranks = _check_rank(config, max_lora_rank)
    _check_targets(config, spec)
    if not (folder / WEIGHTS_FILE).is_file():
        raise invalid("missing_weights", f"{WEIGHTS_FILE} is missing", WEIGHTS_FILE)
    try:
        tensors = read_header(folder / WEIGHTS_FILE)
    except HeaderError as e:
        reason = "truncated" if "truncated" in str(e) else "bad_safetensors"
        raise invalid(reason, str(e), WEIGHTS_FILE) from e
    modules = _check_tensors(tensors, ranks, spec, allowed_dtypes)
    return ValidatedAdapter(rank=max(ranks.values()), modules=modules)
