"""Demo LoRA adapters for the embedded model: seeded random PEFT adapters, written once.

They are not trained: each perturbs attention and MLP projections enough that its greedy output
differs from the base model's (B drawn with std 0.1 keeps the text fluent; at 0.3 it turns to
noise, checked with transformers + PEFT on four chat prompts), which is what a newcomer (and the
correctness tests) need to see base and adapters served side by side. Files are PEFT's own
format, so transformers + PEFT load them.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEMO_ADAPTERS_DIRNAME = "demo-adapters"


@dataclass(frozen=True)
class DemoAdapterSpec:
    name: str
    seed: int
    rank: int
    targets: tuple[str, ...]
    b_std: float


DEMO_ADAPTERS = (
    DemoAdapterSpec("demo-attn", seed=1, rank=8, targets=("q_proj", "v_proj"), b_std=0.1),
    DemoAdapterSpec(
        "demo-mlp",
        seed=2,
        rank=16,
        targets=("q_proj", "o_proj", "up_proj", "down_proj"),
        b_std=0.1,
    ),
)


def _projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each Llama projection."""
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(model_dir: Path, spec: DemoAdapterSpec, target: Path) -> None:
    """Write one PEFT adapter for the Llama model in `model_dir` to `target` (atomically)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    shapes = _projection_shapes(config)
    generator = torch.Generator().manual_seed(spec.seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in spec.targets:
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            fan_in, fan_out = shapes[module]
            a = torch.randn(spec.rank, fan_in, generator=generator) / fan_in**0.5
            b = torch.randn(fan_out, spec.rank, generator=generator) * spec.b_std
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.float32).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.float32).contiguous()
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": spec.rank,
        "lora_alpha": 2 * spec.rank,
        "lora_dropout": 0.0,
        "target_modules": list(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp) / spec.name
        work.mkdir()
        save_file(tensors, str(work / "adapter_model.safetensors"))
        (work / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)


def ensure_demo_adapters(model_dir: Path, cache_dir: Path) -> Path:
    """The folder of demo adapters (one subfolder each), written on first use."""
    root = cache_dir / DEMO_ADAPTERS_DIRNAME
    for spec in DEMO_ADAPTERS:
        if not (root / spec.name / "adapter_config.json").is_file():
            write_adapter(model_dir, spec, root / spec.name)
    return root
