"""The disk tier: verify-then-rename, byte-bounded LRU, rebuild after a crash."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from loraplex.adapters_registry.disk_cache import CacheError, DiskCache
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.records import FileEntry


def blob(data: bytes) -> tuple[FileEntry, bytes]:
    return FileEntry("adapter_model.safetensors", hashlib.sha256(data).hexdigest(), len(data)), data


def make_cache(root: Path, capacity: int) -> DiskCache:
    return DiskCache(root, capacity, RegistryMetrics(CollectorRegistry()))


def fetch(cache: DiskCache, version: str, data: bytes, served: bytes | None = None) -> Path:
    entry, _ = blob(data)

    def get(_: FileEntry, dest: Path) -> None:
        dest.write_bytes(served or data)

    return cache.fetch(version, (entry,), get)


def test_fetch_verifies_and_installs(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, 1000)
    path = fetch(cache, "v1", b"x" * 100)
    assert (path / "adapter_model.safetensors").read_bytes() == b"x" * 100
    assert cache.lookup("v1") == path and cache.used_bytes == 100


def test_hash_mismatch_leaves_nothing_behind(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, 1000)
    with pytest.raises(CacheError, match="does not match its hash"):
        fetch(cache, "v1", b"x" * 100, served=b"y" * 100)
    assert cache.lookup("v1") is None
    assert list((tmp_path / "versions").iterdir()) == []
    assert list((tmp_path / "tmp").iterdir()) == []


def test_lru_evicts_by_bytes_and_spares_in_use(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, 250)
    for v in ("v1", "v2"):
        fetch(cache, v, v.encode() * 50)  # 100 bytes each
    cache.lookup("v1")  # v2 is now least recently used
    with cache.in_use("v2"):
        fetch(cache, "v3", b"3" * 100)  # v2 is busy: v1 goes instead
    assert cache.cached() == {"v2", "v3"}
    fetch(cache, "v4", b"4" * 100)
    assert cache.cached() == {"v3", "v4"} and cache.used_bytes == 200
    with pytest.raises(CacheError, match="exceeds the disk cache"):
        fetch(cache, "huge", b"h" * 300)


def test_rebuild_after_crash(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, 1000)
    fetch(cache, "good", b"g" * 100)
    fetch(cache, "damaged", b"d" * 100)
    # A crash mid-download leaves a temp folder; a damaged folder has a short file.
    (tmp_path / "tmp" / "partial").mkdir()
    (tmp_path / "tmp" / "partial" / "adapter_model.safetensors").write_bytes(b"half")
    (tmp_path / "versions" / "damaged" / "adapter_model.safetensors").write_bytes(b"d")
    shutil.copytree(tmp_path / "versions" / "good", tmp_path / "versions" / "no-manifest")
    (tmp_path / "versions" / "no-manifest" / "files.json").unlink()
    cache.close()  # the crashed process lets go of the folder
    again = make_cache(tmp_path, 1000)
    assert again.cached() == {"good"} and again.used_bytes == 100
    assert list((tmp_path / "tmp").iterdir()) == []


def test_one_process_owns_a_cache_folder(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, 1000)
    with pytest.raises(CacheError, match="in use by another process"):
        DiskCache(tmp_path, 1000, RegistryMetrics(CollectorRegistry()), lock_wait_s=0.3)
    cache.close()
    make_cache(tmp_path, 1000).close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda folder: shutil.rmtree(folder),
        lambda folder: (folder / "files.json").unlink(),
        lambda folder: (folder / "adapter_model.safetensors").unlink(),
        lambda folder: (folder / "adapter_model.safetensors").write_bytes(b"x"),
    ],
    ids=["folder-gone", "manifest-gone", "weights-gone", "weights-short"],
)
def test_a_version_damaged_behind_the_cache_is_a_miss_then_installs_again(
    tmp_path: Path, damage: Callable[[Path], object]
) -> None:
    cache = make_cache(tmp_path, 1000)
    fetch(cache, "v", b"x" * 100)
    damage(tmp_path / "versions" / "v")
    assert cache.lookup("v") is None and cache.used_bytes == 0
    fetch(cache, "v", b"x" * 100)  # installs again, over whatever was left
    assert cache.lookup("v") is not None and cache.used_bytes == 100
