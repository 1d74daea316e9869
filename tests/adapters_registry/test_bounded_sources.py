"""Registration reads bounded input and quotes none of it (issue 45, findings 6 and 7): copies stop
at the caps as they read, only regular files on the source's filesystem are read, link loops,
absurd integers, deep regexes, too many or too long module-name patterns and a bad `__metadata__`
are 400s naming the field and the bound, and no message carries more than a short excerpt of a
file."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import boto3
import pytest
from registry_builders import adapter_config, write_adapter

from loraplex.adapters_registry.base import AdapterInvalid, ErrorKind
from loraplex.adapters_registry.base_model import BaseModelSpec, load_base_model_spec
from loraplex.adapters_registry.peft_config import (
    MAX_CONFIG_BYTES,
    MAX_PATTERN_CHARS,
    MAX_PATTERN_KEYS,
)
from loraplex.adapters_registry.s3_store import S3Store
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.sources import fetch_source
from loraplex.adapters_registry.validation import validate_adapter

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
MAX_MESSAGE = 600  # the field, the bound, and an excerpt of at most 80 characters


@pytest.fixture(scope="module")
def dense(dense_model: Path) -> BaseModelSpec:
    return load_base_model_spec(dense_model, "tiny-llama")


def fetch_refused(source: Path | str, dest: Path, settings: RegistrySettings) -> AdapterInvalid:
    dest.mkdir(exist_ok=True)
    with pytest.raises(AdapterInvalid) as err:
        fetch_source(str(source), dest, settings)
    assert err.value.kind is ErrorKind.INVALID and len(err.value.message) < MAX_MESSAGE
    return err.value


def validate_refused(folder: Path, spec: BaseModelSpec, reason: str) -> AdapterInvalid:
    with pytest.raises(AdapterInvalid) as err:
        validate_adapter(
            folder, spec, max_lora_rank=16, allowed_dtypes={"F16", "BF16", "F32"},
            max_weight_abs=RegistrySettings().max_weight_abs,
        )  # fmt: skip
    assert err.value.reason == reason and err.value.kind is ErrorKind.INVALID, err.value.message
    assert len(err.value.message) < MAX_MESSAGE, err.value.message
    return err.value


def test_weights_linked_to_proc_pagemap_are_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    # A "regular file" of size 0 that reads without end: 2.4 GB copied in 8 s before.
    folder = write_adapter(tmp_path / "src")
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).symlink_to("/proc/self/pagemap")
    err = fetch_refused(folder, tmp_path / "dest", RegistrySettings())
    assert err.param == "source" and "another filesystem" in err.message
    assert not (tmp_path / "dest" / WEIGHTS).exists()


def test_a_copy_stops_at_the_cap_as_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever size the source reported (a file growing, a lying filesystem)."""
    folder = write_adapter(tmp_path / "src")
    with (folder / WEIGHTS).open("ab") as f:
        f.truncate(64 << 20)
    monkeypatch.setattr("loraplex.adapters_registry.local_store.LocalStore.size", lambda s, k: 10)
    settings = RegistrySettings(max_adapter_mib=1, disk_cache_gib=1)
    err = fetch_refused(folder, tmp_path / "dest", settings)
    assert err.reason == "size" and "holds more than" in err.message
    assert "registry.max_adapter_mib allows at most 1048576" in err.message
    assert (tmp_path / "dest" / WEIGHTS).stat().st_size <= (1 << 20) + (1 << 20)  # + one chunk


def test_an_s3_copy_stops_at_the_cap_as_it_reads(
    tmp_path: Path, bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_adapter(tmp_path / "src")
    with (folder / WEIGHTS).open("ab") as f:
        f.truncate(12 << 20)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for f in folder.iterdir():
        s3.upload_file(str(f), bucket, f"src/{f.name}")
    monkeypatch.setattr(S3Store, "size", lambda s, k: 10)  # the object replaced after its HEAD
    settings = RegistrySettings(
        s3_endpoint_url=s3_endpoint, max_adapter_mib=1, disk_cache_gib=1, transfer_chunk_mib=5
    )
    err = fetch_refused(f"s3://{bucket}/src/", tmp_path / "dest", settings)
    assert err.reason == "size" and "at most 1048576" in err.message


def test_a_symlink_loop_is_a_400(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "src")
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).symlink_to(folder / "loop-b")
    (folder / "loop-b").symlink_to(folder / WEIGHTS)
    err = fetch_refused(folder, tmp_path / "dest", RegistrySettings())
    assert err.param == "source" and "loop" in err.message


def test_a_config_linked_to_a_large_host_file_is_refused_by_size_unread(tmp_path: Path) -> None:
    host_file = tmp_path / "host-file"
    host_file.write_bytes(b"secret " * (3 << 20))  # 21 MiB
    folder = write_adapter(tmp_path / "src")
    (folder / CONFIG).unlink()
    (folder / CONFIG).symlink_to(host_file)
    err = fetch_refused(folder, tmp_path / "dest", RegistrySettings())
    assert err.param == CONFIG and err.reason == "size" and "secret" not in err.message
    assert f"MAX_CONFIG_BYTES allows at most {MAX_CONFIG_BYTES}" in err.message
    assert not (tmp_path / "dest" / CONFIG).exists()


def test_an_80_mb_config_is_refused_by_its_size_before_it_is_read(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "src")
    with (folder / CONFIG).open("ab") as f:
        f.truncate(80_000_000)
    err = fetch_refused(folder, tmp_path / "dest", RegistrySettings())
    assert err.param == CONFIG and "is 80000000 bytes" in err.message
    assert not (tmp_path / "dest" / CONFIG).exists()


def test_a_config_that_is_not_utf8_json_quotes_none_of_it(
    tmp_path: Path, dense: BaseModelSpec
) -> None:
    folder = write_adapter(tmp_path / "a")
    (folder / CONFIG).write_bytes(b"\x80secret-host-bytes" * 10_000)  # 180 KB
    err = validate_refused(folder, dense, "bad_config")
    assert err.param == CONFIG and "secret" not in err.message


@pytest.mark.parametrize("field", ["r", "lora_alpha"])
def test_integers_of_5001_digits_are_refused_naming_the_field_and_the_bound(
    tmp_path: Path, dense: BaseModelSpec, field: str
) -> None:
    folder = write_adapter(tmp_path / "a")
    text = json.dumps(adapter_config()).replace(f'"{field}": ', f'"{field}": {"9" * 5001}, "x": ')
    (folder / CONFIG).write_text(text)
    err = validate_refused(folder, dense, "bad_config")
    assert err.param == field
    assert "an integer of 5001 digits; at most 20 are read" in err.message


def safetensors_bytes(header: dict | str, data: bytes) -> bytes:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def one_tensor_adapter(folder: Path, entry: str, extra: str = "") -> Path:
    """The rig's adapter whose weights are one lora_A of q_proj at layer 0, its header entry
    written as given (raw JSON text)."""
    write_adapter(folder)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    (folder / WEIGHTS).write_bytes(safetensors_bytes(f'{{{extra}"{name}": {entry}}}', bytes(256)))
    return folder


def test_data_offsets_of_5001_digits_are_a_400(tmp_path: Path, dense: BaseModelSpec) -> None:
    entry = f'{{"dtype": "F16", "shape": [4, 32], "data_offsets": [{"1" * 5001}, 256]}}'
    err = validate_refused(one_tensor_adapter(tmp_path / "a", entry), dense, "bad_safetensors")
    assert "data_offsets" in err.message and "at most 20 are read" in err.message


@pytest.mark.parametrize("metadata", ['{"format": 7}', '["pt"]', '{"format": {"nested": "map"}}'])
def test_a_metadata_that_is_not_a_string_map_is_a_400(
    tmp_path: Path, dense: BaseModelSpec, metadata: str
) -> None:
    entry = '{"dtype": "F16", "shape": [4, 32], "data_offsets": [0, 256]}'
    folder = one_tensor_adapter(tmp_path / "a", entry, extra=f'"__metadata__": {metadata}, ')
    err = validate_refused(folder, dense, "bad_safetensors")
    assert "__metadata__ must map strings to strings" in err.message


def test_headers_are_bounded_by_what_the_base_model_can_take(
    tmp_path: Path, dense: BaseModelSpec
) -> None:
    entry = '{"dtype": "F16", "shape": [4, 32], "data_offsets": [0, 256]}'
    long_name = f'"{"x" * 300}": {entry}, '
    err = validate_refused(one_tensor_adapter(tmp_path / "a", entry, long_name), dense,
                           "bad_safetensors")  # fmt: skip
    assert "tensor name of 300 characters" in err.message and "exceeds 256" in err.message
    # The tiny dense model has 14 linears: at most 28 factors, and 28 * 512 + 64 KiB of header.
    entries = "".join(f'"t{i}": {entry}, ' for i in range(40))
    err = validate_refused(one_tensor_adapter(tmp_path / "b", entry, entries), dense,
                           "bad_safetensors")  # fmt: skip
    assert "header lists more than 28 tensors" in err.message
    padding = f'"__metadata__": {{"pad": "{"x" * 90_000}"}}, '
    err = validate_refused(one_tensor_adapter(tmp_path / "p", entry, padding), dense,
                           "bad_safetensors")  # fmt: skip
    assert f"exceeds the limit of {28 * 512 + 65536} bytes" in err.message
    nine = '{"dtype": "F16", "shape": [1, 1, 1, 1, 1, 1, 1, 1, 128], "data_offsets": [0, 256]}'
    err = validate_refused(one_tensor_adapter(tmp_path / "c", nine), dense, "bad_safetensors")
    assert "at most 8" in err.message


@pytest.mark.parametrize("field", ["rank_pattern", "target_modules", "alpha_pattern"])
def test_regexes_nested_3000_deep_are_a_400(
    tmp_path: Path, dense: BaseModelSpec, field: str
) -> None:
    deep = "(" * 3000 + "q_proj" + ")" * 3000
    value = deep if field == "target_modules" else {deep: 8}
    folder = write_adapter(tmp_path / "a", adapter_config(**{field: value}))
    err = validate_refused(folder, dense, "bad_config")
    assert err.param == field and "nests groups 3000 deep; at most 32" in err.message


TARGETS = r".*\.(q|v)_proj"  # a target_modules regex of two modules a layer


def _keys(count: int, chars: int) -> dict[str, int]:
    """`count` distinct patterns of `chars` characters each, that no module name ends in."""
    return {f"zz{i:0{chars - 2}d}": 4 for i in range(count)}


def validates(folder: Path, spec: BaseModelSpec) -> None:
    validate_adapter(
        folder, spec, max_lora_rank=16, allowed_dtypes={"F16", "BF16", "F32"},
        max_weight_abs=RegistrySettings().max_weight_abs,
    )  # fmt: skip


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_more_pattern_keys_than_the_bound_are_a_400(
    tmp_path: Path, dense: BaseModelSpec, field: str
) -> None:
    """19,490 keys filling the config held the GIL 344 ms compiling (every stream waited)."""
    at_bound = write_adapter(tmp_path / "ok", adapter_config(**{field: _keys(MAX_PATTERN_KEYS, 8)}))
    validates(at_bound, dense)
    past = write_adapter(tmp_path / "a", adapter_config(**{field: _keys(MAX_PATTERN_KEYS + 1, 8)}))
    err = validate_refused(past, dense, "bad_config")
    assert err.param == field
    assert f"has {MAX_PATTERN_KEYS + 1} keys; at most {MAX_PATTERN_KEYS}" in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"rank_pattern": _keys(200, 30), "alpha_pattern": _keys(50, 44)}, "rank_pattern"),
     ({"rank_pattern": _keys(10, 8), "target_modules": TARGETS + "|" + "x" * MAX_PATTERN_CHARS},
      "target_modules")],
    ids=["keys", "target-regex"],
)  # fmt: skip
def test_pattern_text_past_the_bound_is_a_400_naming_the_largest_part(
    tmp_path: Path, dense: BaseModelSpec, fields: dict[str, Any], param: str
) -> None:
    """A single key or regex can be a huge alternation too: one of 256 KiB held the GIL 616 ms."""
    total = sum(len(v) if isinstance(v, str) else sum(map(len, v)) for v in fields.values())
    assert total > MAX_PATTERN_CHARS
    err = validate_refused(write_adapter(tmp_path / "a", adapter_config(**fields)), dense,
                           "bad_config")  # fmt: skip
    assert err.param == param
    assert f"hold {total} characters; at most {MAX_PATTERN_CHARS}" in err.message
    within = {k: dict(list(v.items())[:100]) if isinstance(v, dict) else TARGETS
              for k, v in fields.items()}  # fmt: skip
    validates(write_adapter(tmp_path / "ok", adapter_config(**within)), dense)


def test_a_link_to_a_file_outside_the_source_on_its_filesystem_still_reads(tmp_path: Path) -> None:
    """A Hugging Face hub snapshot links each file to ../../blobs/."""
    blobs = write_adapter(tmp_path / "blobs")
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for name in (CONFIG, WEIGHTS):
        (snapshot / name).symlink_to(os.path.relpath(blobs / name, snapshot))
    (tmp_path / "dest").mkdir()
    fetch_source(str(snapshot), tmp_path / "dest", RegistrySettings())
    assert (tmp_path / "dest" / WEIGHTS).read_bytes() == (blobs / WEIGHTS).read_bytes()
