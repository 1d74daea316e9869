"""What the registry benches run the registry's own code against: no engine, a tiny base model.

The engine's cost is not the registry's, so `StubEngine` loads nothing; the base model and the
adapter are the smallest a registration validates: one 32x32 q_proj, and a rank-8 LoRA on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from loraplex.adapters_registry.base import ServableAdapter

TINY_MODEL_NAME = "tiny"


class StubEngine:
    async def add_lora(self, adapter: ServableAdapter) -> None:
        return None

    async def remove_lora(self, engine_id: int) -> None:
        return None

    async def pin_lora(self, engine_id: int) -> None:
        return None

    async def list_loras(self) -> set[int]:
        return set()


def write_tiny_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 32, "intermediate_size": 64}))
    save_file({"model.layers.0.self_attn.q_proj.weight": np.zeros((32, 32), np.float16)},
              str(folder / "model.safetensors"))  # fmt: skip
    return folder


def write_tiny_adapter(folder: Path, seed: int = 0) -> Path:
    """A PEFT adapter (rank 8 on the tiny model's q_proj) that registration accepts."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
              "target_modules": ["q_proj"], "bias": "none"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {
        f"{module}.lora_A.weight": rng.standard_normal((8, 32)).astype(np.float16),
        f"{module}.lora_B.weight": rng.standard_normal((32, 8)).astype(np.float16),
    }
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
