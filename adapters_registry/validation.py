"""Checking an adapter against the served base model before anything serves it.

vLLM accepts adapters that then silently serve (part of) the base model: a target module the
model does not have is skipped, a tensor of the wrong shape fails only at load inside the engine,
a NaN weight poisons the batches it joins, and on an engine started with `lora_target_modules`
the LoRA of a module outside that list loads and is never applied. Here every field, every
tensor's header and every value is checked up front; the first problem raises AdapterInvalid
naming the field or tensor, the bound, and a fixed `reason` label for metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters_registry.base import AdapterInvalid
from loraplex.adapters_registry.base_model import BaseModelSpec
from loraplex.adapters_registry.engine import LoraTargets
from loraplex.adapters_registry.peft_config import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    CheckedConfig,
    PatternClock,
    check_config,
    invalid,
    rank_for,
)
from loraplex.adapters_registry.tensors import (
    MAX_NAME_CHARS,
    HeaderError,
    TensorInfo,
    read_header,
)
from loraplex.adapters_registry.values import ServedTensor, check_values, served_scale

WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# A header entry is a name (at most MAX_NAME_CHARS) and ~90 bytes of dtype, shape and offsets;
# PEFT's __metadata__ is {"format": "pt"}.
HEADER_BYTES_PER_TENSOR = MAX_NAME_CHARS + 256
METADATA_BYTES = 64 * 1024
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class ValidatedAdapter:
    rank: int
    modules: int


def too_large(
    file: str, size: int, limit: int, bound: str = "registry.max_adapter_mib", *, read: bool = False
) -> AdapterInvalid:
    """The refusal of an adapter past a size bound: `file` is `size` bytes, or with `read`,
    its copy stopped after `size` bytes (a file can list as 0 bytes and read without end)."""
    what = "adapter" if file == WEIGHTS_FILE else file
    has = f"holds more than {limit} bytes (read {size})" if read else f"is {size} bytes"
    return invalid("size", f"{what} {has}; {bound} allows at most {limit}", file)


def check_listing(files: Mapping[str, int], max_bytes: int) -> None:
    """Given the source's file names -> sizes, refuse missing, pickle-only or oversized adapters
    (the config past MAX_CONFIG_BYTES: it is parsed whole)."""
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
    if files[CONFIG_FILE] > MAX_CONFIG_BYTES:
        raise too_large(CONFIG_FILE, files[CONFIG_FILE], MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES")
    size = files[CONFIG_FILE] + files[WEIGHTS_FILE]
    if size > max_bytes:
        raise too_large(WEIGHTS_FILE, size, max_bytes)


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


def _pattern_name(module: str, spec: BaseModelSpec) -> str:
    """The name rank_pattern and alpha_pattern are matched against: a fused expert LoRA's
    parameter (`<group>.gate_up_proj`), else the module's own."""
    fused = _fused_expert(module, spec)
    return f"{fused[0]}.{fused[1]}" if fused is not None else module


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
    module: str, side: str, ranks: dict[str, int], spec: BaseModelSpec, clock: PatternClock
) -> tuple[int, int]:
    """(rows, cols) the LoRA factor for `module` must have on `spec`; raises if no such module."""
    fused = _fused_expert(module, spec)
    if fused is not None and spec.moe is not None:
        group, param = fused
        moe = spec.moe
        # The 3D layout stacks the experts' rank-r factors: (r * E, in) and (out, r * E).
        er = rank_for(ranks, f"{group}.{param}", clock) * moe.num_experts
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
    rank = rank_for(ranks, module, clock)
    return (rank, in_f) if side == "A" else (out_f, rank)


def _check_served(module: str, targets: LoraTargets | None) -> None:
    """Refuse LoRA on `module` if the engine's `lora_target_modules` leaves it unwrapped."""
    if targets is None or targets.serves(module):
        return
    raise invalid(
        "untargeted_module",
        f"module `{module}` has LoRA, but the engine applies LoRA only to modules matching "
        f"lora_target_modules {list(targets.modules)}: vLLM would serve this adapter without "
        "that module's LoRA",
        module,
    )


def untargeted_module(weights: Path, targets: LoraTargets) -> str | None:
    """The first module `weights` (a registered version's safetensors file) gives LoRA to that an
    engine restricted to `targets` leaves unwrapped, or None. Reads the header only: the file
    passed validation at registration."""
    modules = dict.fromkeys(_split_tensor_name(name)[0] for name in read_header(weights))
    return next((m for m in modules if not targets.serves(m)), None)


def _check_tensors(
    tensors: dict[str, TensorInfo],
    config: CheckedConfig,
    spec: BaseModelSpec,
    dtypes: set[str],
    clock: PatternClock,
    targets: LoraTargets | None,
) -> list[ServedTensor]:
    """Each tensor with the factor it is served at; raises on a name, dtype, shape or a module
    the engine does not wrap."""
    if not tensors:
        raise invalid("missing_weights", f"{WEIGHTS_FILE} holds no tensors", WEIGHTS_FILE)
    sides: dict[str, set[str]] = {}
    served = []
    for name, info in tensors.items():
        module, side = _split_tensor_name(name)
        if info.dtype not in dtypes:
            raise invalid(
                "dtype", f"tensor `{name}` is {info.dtype}; allowed: {sorted(dtypes)}", name
            )
        expected = _expected_shape(module, side, config.ranks, spec, clock)
        if info.shape != expected:
            raise invalid(
                "tensor_shape",
                f"tensor `{name}` has shape {list(info.shape)}; {spec.name} needs "
                f"{list(expected)} for lora_{side} of `{module}`",
                name,
            )
        if module not in sides:
            _check_served(module, targets)
        sides.setdefault(module, set()).add(side)
        scale = served_scale(config, _pattern_name(module, spec), clock) if side == "B" else 1.0
        served.append(ServedTensor(info, scale))
    for module, seen in sides.items():
        if seen != {"A", "B"}:
            missing = "B" if "A" in seen else "A"
            raise invalid("tensor_name", f"module `{module}` has no lora_{missing}", module)
    return served


def validate_adapter(
    folder: Path,
    spec: BaseModelSpec,
    *,
    max_lora_rank: int,
    allowed_dtypes: set[str],
    max_weight_abs: float,
    targets: LoraTargets | None = None,
) -> ValidatedAdapter:
    """Check `folder` (adapter_config.json + adapter_model.safetensors) against `spec`, every
    weight within `max_weight_abs` as served (`values`), every module's LoRA applied by the
    engine (`targets`: its `lora_target_modules`, None when unrestricted).

    Blocking (reads the whole weights file once). Raises AdapterInvalid; mutates nothing.
    """
    clock = PatternClock()
    config = check_config(folder, spec, max_lora_rank, clock)
    if not (folder / WEIGHTS_FILE).is_file():
        raise invalid("missing_weights", f"{WEIGHTS_FILE} is missing", WEIGHTS_FILE)
    # Two factors for each module that can take LoRA, and each fused expert group's two pairs.
    max_tensors = 2 * (len(spec.linear) + 2 * len(spec.expert_groups))
    try:
        tensors = read_header(
            folder / WEIGHTS_FILE,
            max_tensors=max_tensors,
            max_header_bytes=max_tensors * HEADER_BYTES_PER_TENSOR + METADATA_BYTES,
        )
    except HeaderError as e:
        reason = "truncated" if "truncated" in str(e) else "bad_safetensors"
        raise invalid(reason, str(e), WEIGHTS_FILE) from e
    served = _check_tensors(tensors, config, spec, allowed_dtypes, clock, targets)
    check_values(folder / WEIGHTS_FILE, served, max_weight_abs)
    modules = len(served) // 2  # an A and a B each
    return ValidatedAdapter(rank=max(config.ranks.values()), modules=modules)
