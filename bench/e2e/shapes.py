"""The model shapes the e2e bench serves with dummy weights, and adapters that fit them.

Two families (`--model`): `qwen3-30b-a3b` (Qwen3MoeForCausalLM: 48 layers, 128 experts top-8,
experts stored per expert, so adapters name `mlp.experts.{e}.gate_proj` ...) and `gpt-oss-20b`
(GptOssForCausalLM as vLLM 0.26 builds it, vllm/model_executor/models/gpt_oss.py: 24 layers, 32
experts top-4 with biases and the clamped `swigluoai` activation, attention with sinks and biases,
a 128-token sliding window on every even layer, YaRN RoPE). GPT-OSS's config is the published
openai/gpt-oss-20b config.json without its `quantization_config`: vLLM then builds bf16 experts
(no mxfp4 method), which is what load_format="dummy" fills.

GPT-OSS stores its experts fused as 3D parameters (`is_3d_moe_weight`), and vLLM 0.26 loads its
MoE adapters in PEFT's `target_parameters` layout (lora/model_manager.py `_stack_moe_lora_weights`):
per layer `mlp.experts.base_layer.lora_A/B` for gate_up_proj, (r x E, hidden) and
(2 x intermediate, r x E), and `mlp.experts.lora_A/B` for down_proj, (r x E, intermediate) and
(hidden, r x E). Attention adapters name `self_attn.q_proj` ..., which the model's weight mapper
turns into `attn.qkv_proj`'s packed slices.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RANK = 32

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False,
}  # fmt: skip

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
    "num_experts_per_tok": 4, "experts_per_token": 4, "vocab_size": 201088,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "sliding_window": 128, "attention_bias": True, "attention_dropout": 0.0,
    "swiglu_limit": 7.0, "initial_context_length": 4096, "hidden_act": "silu",
    "router_aux_loss_coef": 0.9, "output_router_logits": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": 200002, "pad_token_id": 199999, "use_cache": True,
}  # fmt: skip

MODELS: dict[str, dict[str, Any]] = {"qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B}

# vLLM's LoRA target modules (`--lora-target-modules`, runtime names) that hold every module the
# workload's adapters train: attention's packed qkv_proj, o_proj, and the experts. Without them
# vLLM wraps the MoE router too (GPT-OSS `router`, Qwen3 `gate`) and runs its LoRA on zero weights
# every step: ~180 us of a 4.7 ms GPT-OSS decode step on the H200 (docs/kernels.md).
ADAPTER_TARGETS = ("qkv_proj", "o_proj", "experts")


@dataclass(frozen=True)
class Dims:
    """What an adapter's shapes depend on."""

    layers: int
    hidden: int
    inter: int  # one expert's intermediate size
    experts: int
    q: int  # attention heads x head_dim
    kv: int
    fused_experts: bool  # 3D expert parameters (GPT-OSS) rather than per-expert modules


def dims(cfg: dict[str, Any]) -> Dims:
    fused = cfg["model_type"] == "gpt_oss"
    return Dims(
        layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
        inter=cfg["intermediate_size"] if fused else cfg["moe_intermediate_size"],
        experts=cfg["num_local_experts"] if fused else cfg["num_experts"],
        q=cfg["num_attention_heads"] * cfg["head_dim"],
        kv=cfg["num_key_value_heads"] * cfg["head_dim"], fused_experts=fused,
    )  # fmt: skip


# The e2e check's small real-weight Qwen3-MoE (bench_e2e.make_small_model) as adapters see it.
SMALL_CHECK = Dims(layers=4, hidden=512, inter=256, experts=32, q=512, kv=128, fused_experts=False)


def model_config(
    model: str, layers: int | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`model`'s config with `layers` layers (GPT-OSS's alternating layer_types follow)."""
    cfg = {**MODELS[model], **(overrides or {})}
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if cfg["model_type"] == "gpt_oss":
        n = cfg["num_hidden_layers"]
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(n)]  # fmt: skip
    return cfg


def make_model(
    path: Path, model: str, layers: int | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """config.json of `model_config(...)` in `path`; returns the config."""
    cfg = model_config(model, layers, overrides)
    path.mkdir(parents=True, exist_ok=True)
    part = path / f".config.json.{os.getpid()}"
    part.write_text(json.dumps(cfg))
    part.replace(path / "config.json")
    return cfg


def build_once(path: Path, marker: str, build: Callable[[Path], None]) -> None:
    """Unless `path/marker` exists, `build` a folder beside `path` and move it there whole:
    two processes making the same files at once (a session's two GPUs) never read each other's
    half-written ones. The second to finish drops its copy."""
    if (path / marker).exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    build(part)
    try:
        part.rename(path)  # replaces an empty folder; a full one (the other's) stays
    except OSError:
        shutil.rmtree(part, ignore_errors=True)


def adapter_shapes(d: Dims) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """PEFT module name (without `.lora_A.weight`) -> (lora_A shape, lora_B shape), rank RANK
    on q/k/v/o and every expert's gate/up/down (module docstring for the fused layout)."""
    r = RANK
    per_layer = {
        "self_attn.q_proj": (d.hidden, d.q), "self_attn.k_proj": (d.hidden, d.kv),
        "self_attn.v_proj": (d.hidden, d.kv), "self_attn.o_proj": (d.q, d.hidden),
    }  # fmt: skip
    shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
    for layer in range(d.layers):
        p = f"base_model.model.model.layers.{layer}."
        for mod, (i, o) in per_layer.items():
            shapes[p + mod] = ((r, i), (o, r))
        if d.fused_experts:
            re = r * d.experts
            shapes[p + "mlp.experts.base_layer"] = ((re, d.hidden), (2 * d.inter, re))
            shapes[p + "mlp.experts"] = ((re, d.inter), (d.hidden, re))
            continue
        for e in range(d.experts):
            for name, (i, o) in {"gate_proj": (d.hidden, d.inter), "up_proj": (d.hidden, d.inter),
                                 "down_proj": (d.inter, d.hidden)}.items():  # fmt: skip
                shapes[f"{p}mlp.experts.{e}.{name}"] = ((r, i), (o, r))
    return shapes


def adapter_config(d: Dims) -> dict[str, Any]:
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    cfg: dict[str, Any] = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "bias": "none",
                           "task_type": "CAUSAL_LM"}  # fmt: skip
    if d.fused_experts:
        fused = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        return {**cfg, "target_modules": attention, "target_parameters": fused}
    return {**cfg, "target_modules": [*attention, "gate_proj", "up_proj", "down_proj"]}


def make_adapter(path: Path, d: Dims, seed: int, scale: float = 0.01) -> None:
    """A random adapter of adapter_shapes(d) (bf16), unless `path` holds one already."""

    def build(folder: Path) -> None:
        import torch
        from safetensors.torch import save_file

        device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: dry runs of the scripts
        gen = torch.Generator(device=device).manual_seed(seed)
        tensors = {}
        for name, (a, b) in adapter_shapes(d).items():
            for factor, shape in (("lora_A", a), ("lora_B", b)):
                t = torch.randn(*shape, device=device, generator=gen) * scale
                tensors[f"{name}.{factor}.weight"] = t.bfloat16().cpu()
        save_file(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config(d)))

    build_once(path, "adapter_model.safetensors", build)


def checkpoint_shapes(cfg: dict[str, Any]) -> dict[str, list[int]]:
    """Every tensor of the model's Hugging Face checkpoint: name -> shape (headers only are
    written, see serve_e2e.write_shape_only_checkpoint; adapter validation reads them)."""
    d, v = dims(cfg), cfg["vocab_size"]
    h, heads = d.hidden, cfg["num_attention_heads"]
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [v, h], "lm_head.weight": [v, h],
                                    "model.norm.weight": [h]}  # fmt: skip
    for i in range(d.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [d.q, h], p + "self_attn.k_proj.weight": [d.kv, h],
            p + "self_attn.v_proj.weight": [d.kv, h], p + "self_attn.o_proj.weight": [h, d.q],
        }  # fmt: skip
        if d.fused_experts:
            shapes |= {
                p + "self_attn.q_proj.bias": [d.q], p + "self_attn.k_proj.bias": [d.kv],
                p + "self_attn.v_proj.bias": [d.kv], p + "self_attn.o_proj.bias": [h],
                p + "self_attn.sinks": [heads],
                p + "mlp.router.weight": [d.experts, h], p + "mlp.router.bias": [d.experts],
                p + "mlp.experts.gate_up_proj": [d.experts, h, 2 * d.inter],
                p + "mlp.experts.gate_up_proj_bias": [d.experts, 2 * d.inter],
                p + "mlp.experts.down_proj": [d.experts, d.inter, h],
                p + "mlp.experts.down_proj_bias": [d.experts, h],
            }  # fmt: skip
            continue
        shapes |= {p + "self_attn.q_norm.weight": [cfg["head_dim"]],
                   p + "self_attn.k_norm.weight": [cfg["head_dim"]],
                   p + "mlp.gate.weight": [d.experts, h]}  # fmt: skip
        for e in range(d.experts):
            q = f"{p}mlp.experts.{e}."
            shapes |= {q + "gate_proj.weight": [d.inter, h], q + "up_proj.weight": [d.inter, h],
                       q + "down_proj.weight": [h, d.inter]}  # fmt: skip
    return shapes


def write_shape_only_checkpoint(model_dir: Path, cfg: dict[str, Any]) -> None:
    """model.safetensors with checkpoint_shapes' headers (bf16) and no data written (sparse)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in checkpoint_shapes(cfg).items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(model_dir / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)
