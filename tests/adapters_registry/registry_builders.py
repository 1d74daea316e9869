"""Tiny base models and PEFT adapters written to disk for the registry's tests.

Shapes are small (hidden 32) so files are kilobytes; the layouts are the real ones: Llama-style
names, PEFT tensor names `base_model.model.<module>.lora_{A,B}.weight`, MoE experts per expert or
fused as 3D parameters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

HIDDEN, INTER, LAYERS, EXPERTS, MOE_INTER = 32, 64, 2, 4, 16
DENSE_SHAPES = {  # module -> (out_features, in_features)
    "self_attn.q_proj": (32, 32),
    "self_attn.k_proj": (16, 32),
    "self_attn.v_proj": (16, 32),
    "self_attn.o_proj": (32, 32),
    "mlp.gate_proj": (INTER, 32),
    "mlp.up_proj": (INTER, 32),
    "mlp.down_proj": (32, INTER),
}


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float16)


def write_base_model(folder: Path, moe: str | None = None) -> Path:
    """A model directory; `moe` is None (dense), "fused" (3D experts) or "per_expert"."""
    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
    }  # fmt: skip
    tensors = {"model.embed_tokens.weight": _zeros(100, HIDDEN), "lm_head.weight": _zeros(100, 32)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = _zeros(HIDDEN)
        for module, shape in DENSE_SHAPES.items():
            if moe and module.startswith("mlp."):
                continue
            tensors[f"{prefix}.{module}.weight"] = _zeros(*shape)
        if moe == "fused":
            tensors[f"{prefix}.mlp.experts.gate_up_proj"] = _zeros(EXPERTS, HIDDEN, 2 * MOE_INTER)
            tensors[f"{prefix}.mlp.experts.down_proj"] = _zeros(EXPERTS, MOE_INTER, HIDDEN)
        elif moe == "per_expert":
            for e in range(EXPERTS):
                for proj, shape in (
                    ("gate_proj", (MOE_INTER, HIDDEN)),
                    ("up_proj", (MOE_INTER, HIDDEN)),
                    ("down_proj", (HIDDEN, MOE_INTER)),
                ):
                    tensors[f"{prefix}.mlp.experts.{e}.{proj}.weight"] = _zeros(*shape)
        if moe:
            tensors[f"{prefix}.mlp.gate.weight"] = _zeros(EXPERTS, HIDDEN)
    if moe:
        config.update(num_experts=EXPERTS, moe_intermediate_size=MOE_INTER)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def adapter_config(rank: int = 4, targets: Any = ("q_proj", "v_proj"), **extra: Any) -> dict:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(targets) if not isinstance(targets, str) else targets,
        "bias": "none", **extra,
    }  # fmt: skip


def dense_tensors(
    rank: int = 4, modules: tuple[str, ...] = ("self_attn.q_proj", "self_attn.v_proj"),
    dtype: Any = np.float16, seed: int = 0,
) -> dict[str, np.ndarray]:  # fmt: skip
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module in modules:
            out_f, in_f = DENSE_SHAPES[module]
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.standard_normal((rank, in_f)).astype(dtype)
            tensors[f"{name}.lora_B.weight"] = rng.standard_normal((out_f, rank)).astype(dtype)
    return tensors


def per_expert_tensors(rank: int = 4) -> dict[str, np.ndarray]:
    tensors = {}
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            for proj, (out_f, in_f) in (
                ("gate_proj", (MOE_INTER, HIDDEN)),
                ("down_proj", (HIDDEN, MOE_INTER)),
            ):
                name = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                tensors[f"{name}.lora_A.weight"] = _zeros(rank, in_f)
                tensors[f"{name}.lora_B.weight"] = _zeros(out_f, rank)
    return tensors


def fused_expert_tensors(rank: int = 4) -> dict[str, np.ndarray]:
    """PEFT's `target_parameters` layout: experts stacked along the rank dimension."""
    tensors, er = {}, rank * EXPERTS
    for layer in range(LAYERS):
        group = f"base_model.model.model.layers.{layer}.mlp.experts"
        tensors[f"{group}.base_layer.lora_A.weight"] = _zeros(er, HIDDEN)
        tensors[f"{group}.base_layer.lora_B.weight"] = _zeros(2 * MOE_INTER, er)
        tensors[f"{group}.lora_A.weight"] = _zeros(er, MOE_INTER)
        tensors[f"{group}.lora_B.weight"] = _zeros(HIDDEN, er)
    return tensors


def write_adapter(
    folder: Path, config: dict | None = None, tensors: dict[str, np.ndarray] | None = None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config or adapter_config()))
    save_file(
        tensors if tensors is not None else dense_tensors(),
        str(folder / "adapter_model.safetensors"),
    )
    return folder
