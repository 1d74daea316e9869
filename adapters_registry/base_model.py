"""What the served base model offers LoRA: its linear modules, their shapes, its MoE experts.

Read once at start from the model directory: `config.json` and the safetensors headers (names and
shapes only, no tensor data). Every 2D `<module>.weight` inside the decoder layers is a linear
module vLLM can put LoRA on, with shape (out_features, in_features). MoE experts appear either
per expert (`...mlp.experts.{e}.gate_proj.weight`) or fused as 3D parameters
(`...mlp.experts.gate_up_proj`, `...mlp.experts.down_proj`); for fused checkpoints the per-expert
modules are derived from the config so adapters in either form can be checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.adapters_registry.tensors import read_header

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    hidden: int
    intermediate: int


@dataclass
class BaseModelSpec:
    """LoRA-capable modules of the base model: name -> (out_features, in_features)."""

    name: str
    linear: dict[str, tuple[int, int]]
    moe: MoeShape | None = None
    # Module paths holding experts, e.g. "model.layers.0.mlp.experts".
    expert_groups: set[str] = field(default_factory=set)

    def matches_target(self, target: str) -> bool:
        """PEFT's rule: a target matches a module whose name is it or ends with '.' + it."""
        return any(m == target or m.endswith("." + target) for m in self.linear)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _moe_shape(config: dict[str, Any]) -> MoeShape | None:
    experts = next((config[k] for k in _EXPERT_COUNT_KEYS if config.get(k)), None)
    if not experts:
        return None
    intermediate = config.get("moe_intermediate_size") or config["intermediate_size"]
    return MoeShape(int(experts), int(config["hidden_size"]), int(intermediate))


def weight_files(model_dir: Path) -> list[Path]:
    """The model's safetensors shards, from its index or its folder; FileNotFoundError if none
    (adapters are validated against these files' headers, so other weight formats cannot serve).
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / f for f in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    return files


def load_base_model_spec(model_dir: Path, name: str) -> BaseModelSpec:
    """Read `model_dir`'s config and safetensors headers (blocking; a few ms per shard)."""
    config = _text_config(json.loads((model_dir / "config.json").read_text()))
    moe = _moe_shape(config)
    linear: dict[str, tuple[int, int]] = {}
    expert_groups: set[str] = set()
    fused_groups: set[str] = set()
    for path in weight_files(model_dir):
        for tensor in read_header(path).values():
            if ".layers." not in tensor.name:
                continue  # embeddings and lm_head: vLLM serves LoRA on decoder linears
            if ".experts." in tensor.name:
                group = tensor.name[: tensor.name.index(".experts.") + len(".experts")]
                expert_groups.add(group)
                if len(tensor.shape) == 3:
                    fused_groups.add(group)
            if tensor.name.endswith(".weight") and len(tensor.shape) == 2:
                out_f, in_f = tensor.shape
                linear[tensor.name.removesuffix(".weight")] = (out_f, in_f)
    if moe is not None:
        for group in fused_groups:
            for e in range(moe.num_experts):
                for proj, shape in (
                    ("gate_proj", (moe.intermediate, moe.hidden)),
                    ("up_proj", (moe.intermediate, moe.hidden)),
                    ("down_proj", (moe.hidden, moe.intermediate)),
                ):
                    linear.setdefault(f"{group}.{e}.{proj}", shape)
    return BaseModelSpec(name=name, linear=linear, moe=moe, expert_groups=expert_groups)
