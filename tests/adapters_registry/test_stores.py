"""Both object stores against the same contract; S3 against moto's real server on loopback."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.adapters_registry.local_store import LocalStore
from loraplex.adapters_registry.s3_store import S3Store
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.store import (
    ObjectExists,
    ObjectMissing,
    ObjectStore,
    StoreUnavailable,
)
from tests.support.s3_fault_proxy import FaultProxy


def s3_settings(endpoint: str, **overrides: object) -> RegistrySettings:
    return RegistrySettings.model_validate(
        {"s3_endpoint_url": endpoint, "transfer_chunk_mib": 5, "s3_max_attempts": 3, **overrides}
    )


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalStore(tmp_path / "store")
    else:
        bucket = request.getfixturevalue("bucket")
        yield S3Store(bucket, "pre/fix", s3_settings(request.getfixturevalue("s3_endpoint")))


def test_small_objects_and_exclusive_create(store: ObjectStore) -> None:
    store.put_bytes("catalog/log/000000000001.json", b"one", if_absent=True)
    with pytest.raises(ObjectExists):
        store.put_bytes("catalog/log/000000000001.json", b"two", if_absent=True)
    assert store.get_bytes("catalog/log/000000000001.json") == b"one"
    with pytest.raises(ObjectMissing):
        store.get_bytes("catalog/log/000000000002.json")
    with pytest.raises(ObjectMissing):
        store.size("nope")


def test_list_keys_sorted_and_after(store: ObjectStore) -> None:
    for i in (3, 1, 2):
        store.put_bytes(f"log/{i:03d}", b"x")
    store.put_bytes("other/001", b"x")
    assert store.list_keys("log/") == ["log/001", "log/002", "log/003"]
    assert store.list_keys("log/", start_after="log/001") == ["log/002", "log/003"]
    store.put_bytes("top", b"x")
    assert store.list_keys("", nested=False) == ["top"]
    assert store.list_keys("log/", nested=False) == ["log/001", "log/002", "log/003"]


def test_large_file_round_trip_with_progress(store: ObjectStore, tmp_path: Path) -> None:
    data = os.urandom(12 * 1024 * 1024 + 17)  # > 2 parts of 5 MiB: multipart + ranged GETs
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    moved: list[int] = []
    store.upload(src, "blobs/big", progress=moved.append)
    assert sum(moved) == len(data) and store.size("blobs/big") == len(data)
    dest = tmp_path / "dest.bin"
    moved.clear()
    store.download("blobs/big", dest, progress=moved.append)
    assert dest.read_bytes() == data and sum(moved) == len(data)


def test_modified_touch_and_delete(store: ObjectStore) -> None:
    """What the start-up sweep relies on (adapters_registry/cleanup.py)."""
    key = "blobs/sha256/" + "a" * 64
    store.put_bytes(key, b"bytes")
    before = store.modified(key)
    time.sleep(1.1)  # S3's LastModified counts whole seconds
    store.touch(key)
    assert store.modified(key) > before and store.get_bytes(key) == b"bytes"
    store.delete(key)
    store.delete(key)  # gone already: no error
    with pytest.raises(ObjectMissing):
        store.modified(key)
    with pytest.raises(ObjectMissing):
        store.touch(key)


def test_local_store_refuses_keys_outside_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="escapes"):
        LocalStore(tmp_path / "s").get_bytes("../../etc/passwd")


def test_s3_retries_500s_and_throttling(
    bucket: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    store = S3Store(bucket, "", s3_settings(fault_proxy.url, s3_max_attempts=4))
    store.put_bytes("blobs/a", b"payload")
    fault_proxy.fail(2, 500, "InternalError")
    assert store.get_bytes("blobs/a") == b"payload"
    fault_proxy.fail(2, 503, "SlowDown")
    assert store.get_bytes("blobs/a") == b"payload"
    assert fault_proxy.hits == 6  # 3 attempts each


def test_s3_gives_up_after_max_attempts(bucket: str, fault_proxy: FaultProxy) -> None:
    store = S3Store(bucket, "", s3_settings(fault_proxy.url, s3_max_attempts=2))
    store.put_bytes("blobs/a", b"payload")
    fault_proxy.fail(5, 500, "InternalError")
    with pytest.raises(StoreUnavailable, match="InternalError"):
        store.get_bytes("blobs/a")


def test_s3_download_survives_reset_mid_body(
    bucket: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    store = S3Store(bucket, "", s3_settings(fault_proxy.url))
    data = os.urandom(11 * 1024 * 1024)
    (tmp_path / "src").write_bytes(data)
    store.upload(tmp_path / "src", "blobs/big")
    fault_proxy.reset(2)
    store.download("blobs/big", tmp_path / "dest")
    assert (tmp_path / "dest").read_bytes() == data


def test_s3_unreachable_endpoint_is_unavailable() -> None:
    store = S3Store("nobucket", "", s3_settings("http://127.0.0.1:9", s3_max_attempts=1,
                                                s3_connect_timeout_s=0.5))  # fmt: skip
    with pytest.raises(StoreUnavailable):
        store.get_bytes("x")
