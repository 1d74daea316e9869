"""Each kind of bad adapter is refused with a reason naming the field or tensor; good ones pass."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
from registry_builders import (
    EXPERTS,
    adapter_config,
    dense_tensors,
    fused_expert_tensors,
    per_expert_tensors,
    write_adapter,
)

from loraplex.adapters_registry.base import AdapterInvalid, ErrorKind
from loraplex.adapters_registry.base_model import BaseModelSpec, load_base_model_spec
from loraplex.adapters_registry.local_store import LocalStore
from loraplex.adapters_registry.peft_config import PatternClock, rank_for
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.sources import fetch_source
from loraplex.adapters_registry.tensors import HeaderError, read_header
from loraplex.adapters_registry.validation import check_listing, validate_adapter


@pytest.fixture(scope="module")
def dense(dense_model: Path) -> BaseModelSpec:
    return load_base_model_spec(dense_model, "tiny-llama")


def check(folder: Path, spec: BaseModelSpec, max_rank: int = 16) -> None:
    validate_adapter(
        folder, spec, max_lora_rank=max_rank, allowed_dtypes={"F16", "BF16", "F32"},
        max_weight_abs=RegistrySettings().max_weight_abs,
    )  # fmt: skip


def refused(folder: Path, spec: BaseModelSpec, reason: str, max_rank: int = 16) -> AdapterInvalid:
    with pytest.raises(AdapterInvalid) as info:
        check(folder, spec, max_rank)
    assert info.value.reason == reason, info.value.message
    assert info.value.kind is ErrorKind.INVALID
    return info.value


def test_base_model_spec_lists_decoder_linears_with_shapes(dense: BaseModelSpec) -> None:
    assert dense.linear["model.layers.1.self_attn.k_proj"] == (16, 32)
    assert dense.linear["model.layers.0.mlp.down_proj"] == (32, 64)
    assert "lm_head" not in dense.linear and "model.embed_tokens" not in dense.linear
    assert dense.moe is None


def test_valid_dense_adapter_passes(tmp_path: Path, dense: BaseModelSpec) -> None:
    check(write_adapter(tmp_path / "a"), dense)


def test_rank_above_max_lora_rank(tmp_path: Path, dense: BaseModelSpec) -> None:
    folder = write_adapter(tmp_path / "a", adapter_config(rank=32), dense_tensors(rank=32))
    err = refused(folder, dense, "rank", max_rank=16)
    assert "r=32" in err.message and "max_lora_rank=16" in err.message and err.param == "r"


def test_wrong_shape_names_the_tensor(tmp_path: Path, dense: BaseModelSpec) -> None:
    tensors = dense_tensors()
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[name] = np.zeros((32, 4), dtype=np.float16)  # v_proj's out is 16
    err = refused(write_adapter(tmp_path / "a", tensors=tensors), dense, "tensor_shape")
    assert err.param == name and "[32, 4]" in err.message and "[16, 4]" in err.message


def test_rank_mismatch_between_config_and_tensors(tmp_path: Path, dense: BaseModelSpec) -> None:
    folder = write_adapter(tmp_path / "a", adapter_config(rank=8), dense_tensors(rank=4))
    refused(folder, dense, "tensor_shape")


def test_unknown_target_module(tmp_path: Path, dense: BaseModelSpec) -> None:
    folder = write_adapter(tmp_path / "a", adapter_config(targets=["q_proj", "c_attn"]))
    err = refused(folder, dense, "target_modules")
    assert "'c_attn'" in err.message and err.param == "target_modules"


def test_lm_head_target_is_refused(tmp_path: Path, dense: BaseModelSpec) -> None:
    refused(write_adapter(tmp_path / "a", adapter_config(targets=["lm_head"])), dense,
            "target_modules")  # fmt: skip


def test_tensor_for_a_module_the_model_lacks(tmp_path: Path, dense: BaseModelSpec) -> None:
    tensors = dense_tensors()
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = np.zeros(
        (4, 32), dtype=np.float16
    )
    err = refused(write_adapter(tmp_path / "a", tensors=tensors), dense, "tensor_name")
    assert "model.layers.7.self_attn.q_proj" in err.message


def test_missing_lora_b(tmp_path: Path, dense: BaseModelSpec) -> None:
    tensors = dense_tensors()
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    err = refused(write_adapter(tmp_path / "a", tensors=tensors), dense, "tensor_name")
    assert "lora_B" in err.message


def test_disallowed_dtype(tmp_path: Path, dense: BaseModelSpec) -> None:
    folder = write_adapter(tmp_path / "a", tensors=dense_tensors(dtype=np.float64))
    assert "F64" in refused(folder, dense, "dtype").message


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("use_dora", True, "unsupported_feature"),
        ("bias", "lora_only", "unsupported_feature"),
        ("modules_to_save", ["lm_head"], "unsupported_feature"),
        ("init_lora_weights", "pissa", "unsupported_feature"),
        ("peft_type", "IA3", "not_lora"),
    ],
)
def test_refused_features_are_named(
    tmp_path: Path, dense: BaseModelSpec, field: str, value: Any, reason: str
) -> None:
    folder = write_adapter(tmp_path / "a", adapter_config(**{field: value}))
    assert refused(folder, dense, reason).param == field


@pytest.mark.parametrize(
    ("change", "param", "named"),
    [
        ({"lora_alpha": None}, "lora_alpha", "lora_alpha must be a number"),
        ({"lora_alpha": "16"}, "lora_alpha", "lora_alpha must be a number"),
        ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern", "map patterns to numbers"),
        ({"target_modules": None}, "target_modules", "target_modules is missing"),
        ({"target_modules": "(q_proj"}, "target_modules", "not a valid regex"),
        ({"rank_pattern": {"(q_proj": 4}}, "rank_pattern", "not a valid regex"),
        ({"alpha_pattern": {"[": 8}}, "alpha_pattern", "not a valid regex"),
    ],
    ids=["no-alpha", "alpha-string", "alpha-pattern-value", "no-target-modules",
         "target-regex", "rank-pattern-regex", "alpha-pattern-regex"],
)  # fmt: skip
def test_configs_vllm_refuses_at_load_are_refused_at_registration(
    tmp_path: Path, dense: BaseModelSpec, change: dict, param: str, named: str
) -> None:
    # vLLM's PEFTHelper requires r, lora_alpha and the target_modules key, and compiles the
    # patterns: each of these registered, then failed every request's load.
    config = adapter_config()
    for key, value in change.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    err = refused(write_adapter(tmp_path / "a", config), dense, "bad_config")
    assert err.param == param and named in err.message


def test_dora_magnitude_tensor_is_refused(tmp_path: Path, dense: BaseModelSpec) -> None:
    tensors = dense_tensors()
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = np.ones(
        32, dtype=np.float16
    )
    refused(write_adapter(tmp_path / "a", tensors=tensors), dense, "unsupported_feature")


def test_truncated_safetensors(tmp_path: Path, dense: BaseModelSpec) -> None:
    folder = write_adapter(tmp_path / "a")
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "truncated" in refused(folder, dense, "truncated").message


def test_header_longer_than_file(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(HeaderError, match="truncated"):
        read_header(path)


def raw_safetensors(path: Path, header: dict, data_bytes: int) -> Path:
    """A safetensors file with this header, byte for byte, and `data_bytes` zero bytes of data."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data_bytes))
    return path


def f16(shape: list[int], begin: int) -> dict:
    size = 2 * math.prod(shape)
    return {"dtype": "F16", "shape": shape, "data_offsets": [begin, begin + size]}


@pytest.mark.parametrize(
    ("header", "data_bytes", "match"),
    [
        ({"a": f16([2, 2], 0), "b": f16([2, 2], 12)}, 20, "gap"),
        ({"a": f16([2, 2], 0), "b": f16([2, 2], 4)}, 12, "overlaps"),
        ({"a": f16([2, 2], 0)}, 9, "trailing bytes"),
        ({"a": {"dtype": "F16", "shape": [True, 2], "data_offsets": [0, 4]}}, 4, "shape"),
    ],
    ids=["gap", "overlap", "trailing", "bool-dimension"],
)
def test_tensors_must_tile_the_data_as_safetensors_requires(
    tmp_path: Path, header: dict, data_bytes: int, match: str
) -> None:
    # Each passes a per-tensor bounds check, and each the safetensors library refuses at load.
    path = raw_safetensors(tmp_path / "x.safetensors", header, data_bytes)
    with pytest.raises(safetensors.SafetensorError):
        safetensors.safe_open(str(path), "np")
    with pytest.raises(HeaderError, match=match):
        read_header(path)


def test_trailing_bytes_after_a_valid_adapter_are_refused(
    tmp_path: Path, dense: BaseModelSpec
) -> None:
    folder = write_adapter(tmp_path / "a")
    with (folder / "adapter_model.safetensors").open("ab") as f:
        f.write(bytes(1000))
    assert "trailing" in refused(folder, dense, "bad_safetensors").message


def test_garbage_instead_of_safetensors(tmp_path: Path, dense: BaseModelSpec) -> None:
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 4) + b"nope")
    refused(folder, dense, "bad_safetensors")


def test_missing_config(tmp_path: Path, dense: BaseModelSpec) -> None:
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_config.json").unlink()
    refused(folder, dense, "missing_config")


def test_listing_refuses_pickle_only_and_oversize() -> None:
    with pytest.raises(AdapterInvalid, match="pickle") as info:
        check_listing({"adapter_config.json": 10, "adapter_model.bin": 100}, 1000)
    assert info.value.reason == "pickle"
    with pytest.raises(AdapterInvalid, match="at most 1000") as info:
        check_listing({"adapter_config.json": 10, "adapter_model.safetensors": 2000}, 1000)
    assert info.value.reason == "size"
    with pytest.raises(AdapterInvalid) as info:
        check_listing({"adapter_model.safetensors": 10}, 1000)
    assert info.value.reason == "missing_config"


def test_a_source_that_grew_since_its_listing_is_refused_after_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "adapter_config.json").write_text("{}")
    (source / "adapter_model.safetensors").write_bytes(bytes(3 * 2**19))  # 1.5 MiB
    # The sizes the listing saw, before the source was overwritten with bigger files.
    monkeypatch.setattr(LocalStore, "size", lambda self, key: 10)
    settings = RegistrySettings(max_adapter_mib=1, disk_cache_gib=1)
    (tmp_path / "dest").mkdir()
    with pytest.raises(AdapterInvalid, match="at most 1048576") as info:
        fetch_source(str(source), tmp_path / "dest", settings)
    assert info.value.reason == "size"


def test_moe_per_expert_form(
    tmp_path: Path, fused_moe_model: Path, per_expert_moe_model: Path
) -> None:
    config = adapter_config(targets=["gate_proj", "down_proj"])
    folder = write_adapter(tmp_path / "a", config, per_expert_tensors())
    for model in (per_expert_moe_model, fused_moe_model):
        check(folder, load_base_model_spec(model, "tiny-moe"))
    bad = per_expert_tensors()
    bad[f"base_model.model.model.layers.0.mlp.experts.{EXPERTS}.gate_proj.lora_A.weight"] = (
        np.zeros((4, 32), dtype=np.float16)
    )
    folder = write_adapter(tmp_path / "b", config, bad)
    err = refused(folder, load_base_model_spec(fused_moe_model, "tiny-moe"), "tensor_name")
    assert f"experts.{EXPERTS}.gate_proj" in err.message


def test_moe_fused_3d_form(tmp_path: Path, fused_moe_model: Path, dense_model: Path) -> None:
    config = adapter_config(
        targets=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    )
    spec = load_base_model_spec(fused_moe_model, "tiny-moe")
    check(write_adapter(tmp_path / "a", config, fused_expert_tensors()), spec)
    tensors = fused_expert_tensors()
    name = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"
    tensors[name] = np.zeros((32, 4), dtype=np.float16)  # needs (hidden, rank * experts)
    err = refused(write_adapter(tmp_path / "b", config, tensors), spec, "tensor_shape")
    assert err.param == name and f"[32, {4 * EXPERTS}]" in err.message
    dense = load_base_model_spec(dense_model, "tiny-llama")
    refused(write_adapter(tmp_path / "c", config, fused_expert_tensors()), dense, "target_modules")


# About 1.84^length steps against a module name that does not end in a digit: 19.6 s on one of
# the tiny model's 31-character names without a limit (PATTERN_BUDGET_S stops it).
BACKTRACKING = r"([\w.]|[\w.][\w.]|[\w.][\w.][\w.])*\d"


@pytest.mark.parametrize(
    ("change", "param"),
    [({"target_modules": BACKTRACKING}, "target_modules"),
     ({"rank_pattern": {BACKTRACKING: 4}}, "rank_pattern")],
    ids=["target-regex", "rank-pattern-key"],
)  # fmt: skip
def test_a_pattern_that_backtracks_without_end_is_refused(
    tmp_path: Path, dense: BaseModelSpec, change: dict, param: str
) -> None:
    config = adapter_config(**change)
    err = refused(write_adapter(tmp_path / "a", config), dense, "bad_config")
    assert err.param == param and "backtracks too much" in err.message


@pytest.mark.parametrize(
    ("header", "named"),
    [({"t": {"dtype": ["F16"], "shape": [1], "data_offsets": [0, 2]}}, "unknown dtype"),
     ("[" * 200_000, "not valid JSON")],
    ids=["dtype-list", "nested-200k"],
)  # fmt: skip
def test_a_malformed_header_is_a_header_error_not_a_crash(
    tmp_path: Path, header: object, named: str
) -> None:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0\0")
    with pytest.raises(HeaderError, match=named):
        read_header(path)


@pytest.mark.parametrize(
    ("config_text", "param"),
    [("[" * 200_000, "adapter_config.json"),
     (json.dumps(adapter_config(target_parameters=5)), "target_parameters"),
     (json.dumps(adapter_config(target_parameters=["experts.down_proj", 7])), "target_parameters")],
    ids=["nested-200k", "target-parameters-int", "target-parameters-list-int"],
)  # fmt: skip
def test_a_malformed_config_is_refused_naming_the_field(
    tmp_path: Path, dense: BaseModelSpec, config_text: str, param: str
) -> None:
    folder = write_adapter(tmp_path / "a", adapter_config())
    (folder / "adapter_config.json").write_text(config_text)
    assert refused(folder, dense, "bad_config").param == param


@pytest.mark.parametrize(
    "source", ["/" + "x" * 300, "s3://bad_bucket!/x/"], ids=["path-too-long", "bucket-chars"]
)
def test_a_source_that_cannot_name_anything_is_refused_naming_source(
    tmp_path: Path, source: str
) -> None:
    with pytest.raises(AdapterInvalid) as err:
        fetch_source(source, tmp_path, RegistrySettings())
    assert err.value.param == "source" and err.value.kind is ErrorKind.INVALID


def test_a_local_source_file_linked_to_a_device_is_refused_not_read(tmp_path: Path) -> None:
    """/dev/zero lists as 0 bytes and reads without end."""
    folder = write_adapter(tmp_path / "src", adapter_config())
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(AdapterInvalid, match="not a regular file") as err:
        fetch_source(str(folder), tmp_path / "dest", RegistrySettings())
    assert err.value.param == "source"


def test_the_first_rank_pattern_key_that_is_a_suffix_of_the_module_wins() -> None:
    ranks = {"": 4, "q_proj": 8, r"layers\.0\.self_attn\.q_proj": 16, r"(?P<c>\w)(?P=c)_proj": 2}
    assert rank_for(ranks, "model.layers.0.self_attn.q_proj", PatternClock()) == 8
    assert rank_for(ranks, "model.layers.0.self_attn.k_proj", PatternClock()) == 4
    assert rank_for(ranks, "model.layers.0.self_attn.xq_proj", PatternClock()) == 4  # '.'-bound
    assert rank_for(ranks, "model.layers.0.mlp.dd_proj", PatternClock()) == 2  # a group reference
