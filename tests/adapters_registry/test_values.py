"""Adapter values at registration: NaN, infinity and magnitudes past registry.max_weight_abs as
served (lora_B scaled by lora_alpha/r) are refused naming the tensor, the value and where; every
tensor is read once, in bounded chunks; fp32, fp16 and bf16."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from registry_builders import adapter_config, dense_tensors, write_adapter
from registry_rig import Rig, metric
from safetensors.torch import save_file

from loraplex.adapters_registry import values as values_module
from loraplex.adapters_registry.base import AdapterInvalid, ErrorKind
from loraplex.adapters_registry.base_model import BaseModelSpec, load_base_model_spec
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.tensors import read_header
from loraplex.adapters_registry.validation import validate_adapter
from loraplex.adapters_registry.values import ServedTensor, check_values

B_NAME = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"  # (16, rank)
A_NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"  # (rank, 32)
BOUND = RegistrySettings().max_weight_abs
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def dense(dense_model: Path) -> BaseModelSpec:
    return load_base_model_spec(dense_model, "tiny-llama")


def torch_adapter(
    folder: Path, dtype: torch.dtype, config: dict[str, Any] | None = None, **set_values: Any
) -> Path:
    """The rig's dense adapter in `dtype` (safetensors from torch: bf16 too), with
    `set_values[tensor name] = (index, value)` written in."""
    tensors = {k: torch.from_numpy(v.astype(np.float32)) for k, v in dense_tensors().items()}
    for name, (index, value) in set_values.items():
        tensors[name][index] = value
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(config or adapter_config()))
    save_file(
        {k: v.to(dtype) for k, v in tensors.items()}, str(folder / "adapter_model.safetensors")
    )
    return folder


def check(folder: Path, spec: BaseModelSpec, max_weight_abs: float = BOUND) -> None:
    validate_adapter(
        folder, spec, max_lora_rank=16, allowed_dtypes={"F16", "BF16", "F32"},
        max_weight_abs=max_weight_abs,
    )  # fmt: skip


def refused(folder: Path, spec: BaseModelSpec, reason: str) -> AdapterInvalid:
    with pytest.raises(AdapterInvalid) as err:
        check(folder, spec)
    assert err.value.reason == reason and err.value.kind is ErrorKind.INVALID, err.value.message
    return err.value


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("value", "says"), [(float("nan"), "nan"), (float("-inf"), "-inf")])
def test_non_finite_values_are_refused_naming_tensor_value_and_index(
    tmp_path: Path, dense: BaseModelSpec, dtype: str, value: float, says: str
) -> None:
    folder = torch_adapter(tmp_path / "a", DTYPES[dtype], **{B_NAME: ((3, 2), value)})
    err = refused(folder, dense, "non_finite")
    assert err.param == B_NAME
    assert f"tensor `{B_NAME}` holds {says} at [3, 2]" in err.message


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # fp16 cannot hold 1e30
def test_huge_finite_values_are_refused_with_the_bound(
    tmp_path: Path, dense: BaseModelSpec, dtype: str
) -> None:
    folder = torch_adapter(tmp_path / "a", DTYPES[dtype], **{A_NAME: ((1, 31), 1e30)})
    err = refused(folder, dense, "magnitude")
    assert err.param == A_NAME and "at [1, 31]" in err.message
    assert "registry.max_weight_abs (1000)" in err.message
    stored = torch.tensor(1e30, dtype=DTYPES[dtype]).item()  # bf16 rounds it
    assert f"holds {stored:g} at" in err.message


def test_the_bound_applies_to_lora_b_as_served_scaled_by_alpha_over_r(
    tmp_path: Path, dense: BaseModelSpec
) -> None:
    # B = 300 is within the bound as stored, 300 * 16 / 4 = 1200 is not as vLLM serves it.
    config = adapter_config(rank=4, lora_alpha=16)
    folder = torch_adapter(tmp_path / "scaled", torch.float32, config, **{B_NAME: ((0, 0), 300.0)})
    err = refused(folder, dense, "magnitude")
    assert "holds 300 at [0, 0] (1200 once scaled by lora_alpha/r)" in err.message
    # rsLoRA scales by alpha / sqrt(r): 300 * 16 / 2 = 2400
    config = adapter_config(rank=4, lora_alpha=16, use_rslora=True)
    folder = torch_adapter(tmp_path / "rs", torch.float32, config, **{B_NAME: ((0, 0), 300.0)})
    assert "(2400 once scaled" in refused(folder, dense, "magnitude").message
    # alpha_pattern's own scaling for that module, vLLM 0.32's way (0.26 ignores it: the larger)
    config = adapter_config(rank=4, lora_alpha=4, alpha_pattern={"v_proj": 16})
    folder = torch_adapter(tmp_path / "pat", torch.float32, config, **{B_NAME: ((0, 0), 300.0)})
    assert "(1200 once scaled" in refused(folder, dense, "magnitude").message
    # the same B at alpha == r serves 300: accepted
    config = adapter_config(rank=4, lora_alpha=4)
    check(torch_adapter(tmp_path / "ok", torch.float32, config, **{B_NAME: ((0, 0), 300.0)}), dense)


def test_an_infinite_lora_alpha_is_refused(tmp_path: Path, dense: BaseModelSpec) -> None:
    folder = write_adapter(tmp_path / "a")
    text = (
        (folder / "adapter_config.json")
        .read_text()
        .replace('"lora_alpha": 8', '"lora_alpha": 1e999')
    )
    (folder / "adapter_config.json").write_text(text)
    with pytest.raises(AdapterInvalid, match="lora_alpha must be a finite number") as err:
        check(folder, dense)
    assert err.value.param == "lora_alpha"


def test_values_at_the_bound_and_zero_scaled_b_pass(tmp_path: Path, dense: BaseModelSpec) -> None:
    folder = torch_adapter(tmp_path / "a", torch.float32, **{A_NAME: ((0, 0), -BOUND)})
    check(folder, dense)
    config = adapter_config(rank=4, lora_alpha=0)  # served as zeros whatever B holds
    check(torch_adapter(tmp_path / "z", torch.float32, config, **{B_NAME: ((0, 0), 1e30)}), dense)


def test_a_large_tensor_is_read_in_chunks_of_bounded_memory(tmp_path: Path) -> None:
    # 64 MiB of weights: the check's allocations stay within a few 4 MiB chunks.
    path = tmp_path / "big.safetensors"
    save_file({"x": torch.zeros(1 << 20, 16)}, str(path))
    info = read_header(path)["x"]
    with path.open("r+b") as f:  # NaN as the very last element, in the last chunk
        f.seek(info.span[1] - 4)
        f.write(np.array([np.nan], dtype="<f4").tobytes())
    tracemalloc.start()
    try:
        with pytest.raises(AdapterInvalid, match=r"`x` holds nan at \[1048575, 15\]"):
            check_values(path, [ServedTensor(info, 1.0)], BOUND)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * values_module.CHUNK_BYTES, peak


@pytest.mark.anyio
async def test_registration_refuses_a_nan_adapter_and_keeps_nothing(rig: Rig) -> None:
    reg = await rig.registry("a")
    before = (reg.store.list_keys(""), reg.cache.cached(), reg.catalog.last_seq)
    folder = torch_adapter(rig.tmp / "nan", torch.float16, **{B_NAME: ((5, 1), float("nan"))})
    with pytest.raises(AdapterInvalid, match=r"holds nan at \[5, 1\]") as err:
        await reg.register("nan", str(folder))
    assert err.value.param == B_NAME
    assert (reg.store.list_keys(""), reg.cache.cached(), reg.catalog.last_seq) == before
    assert metric(reg, "loraplex_adapter_validation_failures_total", reason="non_finite") == 1
