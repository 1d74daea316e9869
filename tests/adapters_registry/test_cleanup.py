"""Start-up removes what killed processes left behind: `.tmp-*` files, blobs no version
references and orphan cached versions, and never a blob another replica may be registering.
A registration killed with SIGKILL in a process of its own leaves what the issue found."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from registry_builders import write_adapter
from registry_fake_engine import FakeEngine
from registry_rig import Rig

from bench.loadgen.server import REPO
from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.catalog import BLOB_PREFIX
from loraplex.adapters_registry.cleanup import Swept, sweep_leftovers
from loraplex.adapters_registry.lifecycle import build_registry
from loraplex.adapters_registry.local_store import LocalStore
from loraplex.adapters_registry.settings import RegistrySettings

pytestmark = pytest.mark.anyio
HOUR = 3600.0


async def local_registry(
    tmp_path: Path, dense_model: Path, cache: str = "cache", **settings: object
) -> ManagedRegistry:
    return await build_registry(
        RegistrySettings(store=str(tmp_path / "store"), **settings), FakeEngine(),  # type: ignore[arg-type]
        model_dir=dense_model, base_model_name="tiny", max_lora_rank=16, max_loras=2,
        max_cpu_loras=3, cache_root=tmp_path / cache, metrics_registry=CollectorRegistry(),
    )  # fmt: skip


async def sweep(reg: ManagedRegistry) -> Swept:
    """The start-up sweep over `reg`'s catalog and disk cache, with its settings' grace."""
    return await sweep_leftovers(reg.sync, reg.cache, reg.settings.orphan_grace_s)


def leftovers(store_root: Path) -> tuple[Path, Path]:
    """An orphan blob and a half-written `.tmp-*` file, as a killed registration leaves them."""
    blobs = store_root / BLOB_PREFIX
    blobs.mkdir(parents=True, exist_ok=True)
    orphan, partial = blobs / ("e" * 64), blobs / ".tmp-k1ll3d"
    orphan.write_bytes(b"config of a registration that never reached the catalog")
    partial.write_bytes(b"half a weights file")
    return orphan, partial


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


async def test_a_store_no_other_process_uses_is_swept_at_once(
    tmp_path: Path, dense_model: Path
) -> None:
    reg = await local_registry(tmp_path, dense_model)
    info = await reg.register("bot", str(write_adapter(tmp_path / "src")))
    kept = set(reg.store.list_keys(BLOB_PREFIX))
    orphan, partial = leftovers(tmp_path / "store")
    orphan_version = reg.cache.path("f" * 64)
    orphan_version.mkdir()
    (orphan_version / "files.json").write_text("[]")  # a complete, empty, unknown version
    reg.cache.close()
    reg = await local_registry(tmp_path, dense_model)  # the restart, alone on its store
    swept = await sweep(reg)
    assert not orphan.exists() and not partial.exists()
    assert sorted(swept.store) == sorted([f"{BLOB_PREFIX}{'e' * 64}", f"{BLOB_PREFIX}.tmp-k1ll3d"])
    assert set(reg.store.list_keys(BLOB_PREFIX)) == kept  # the version's blobs stay
    assert swept.cache == ["f" * 64] and reg.cache.cached() == {info.version}
    async with reg.lease("bot"):
        pass


async def test_a_shared_store_keeps_what_another_replica_may_be_writing(
    tmp_path: Path, dense_model: Path
) -> None:
    other = LocalStore(tmp_path / "store")
    assert other.claim_users_lock()  # another replica's process (its own lock's file handle)
    other.share_users_lock()
    reg = await local_registry(tmp_path, dense_model)
    young_orphan, young_partial = leftovers(tmp_path / "store")
    old_orphan = young_orphan.with_name("d" * 64)
    old_orphan.write_bytes(b"an hour old")
    old_partial = young_partial.with_name(".tmp-old")
    old_partial.write_bytes(b"an hour old")
    for path in (old_orphan, old_partial):
        age(path, HOUR + 60)
    swept = await sweep(reg)
    assert young_orphan.exists() and young_partial.exists()  # maybe mid-registration
    assert not old_orphan.exists() and not old_partial.exists()
    assert len(swept.store) == 2


async def test_a_registration_reusing_an_old_orphan_blob_renews_it(
    tmp_path: Path, dense_model: Path
) -> None:
    reg = await local_registry(tmp_path, dense_model)
    await reg.register("bot", str(write_adapter(tmp_path / "src")))
    blobs = [tmp_path / "store" / key for key in reg.store.list_keys(BLOB_PREFIX)]
    await reg.delete("bot")  # its blobs are orphans now
    for blob in blobs:
        age(blob, HOUR + 60)
    await reg.register("bot-again", str(write_adapter(tmp_path / "src-again")))  # same bytes
    assert blobs and all(time.time() - blob.stat().st_mtime < 60 for blob in blobs)


async def test_s3_orphans_go_only_past_the_grace_and_stale_multipart_uploads_are_aborted(
    rig: Rig,
) -> None:
    reg = await rig.registry("a")
    info = await reg.register("bot", rig.source("bot"))
    key = f"registry/{BLOB_PREFIX}{'e' * 64}"
    rig.s3.put_object(Bucket=rig.bucket, Key=key, Body=b"orphan")
    assert (await sweep(reg)).store == []  # younger than the hour's grace
    # moto reports every multipart upload as begun in 2010: only its abort is tested here.
    upload = rig.s3.create_multipart_upload(Bucket=rig.bucket, Key=f"registry/{BLOB_PREFIX}x")
    reg.settings = reg.settings.model_copy(update={"orphan_grace_s": 0.0})
    swept = await sweep(reg)
    assert sorted(swept.store) == [f"{BLOB_PREFIX}{'e' * 64}", f"{BLOB_PREFIX}x"]
    uploads = rig.s3.list_multipart_uploads(Bucket=rig.bucket).get("Uploads", [])
    assert upload["UploadId"] not in {u["UploadId"] for u in uploads}
    async with reg.lease("bot") as adapter:  # its blobs stayed
        assert adapter.version == info.version


# A registration in a process of its own whose weights upload stops halfway (as a kill -9 finds
# it: the config's blob published, the weights' in a `.tmp-*` file), then waits to be killed.
KILLED_REGISTRATION = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    from prometheus_client import CollectorRegistry
    sys.path.insert(0, "tests/adapters_registry")
    from registry_fake_engine import FakeEngine
    from loraplex.adapters_registry.lifecycle import build_registry
    from loraplex.adapters_registry.local_store import LocalStore
    from loraplex.adapters_registry.settings import RegistrySettings

    upload = LocalStore.upload

    def upload_half_of_the_weights(self, src, key, progress=None):
        if src.name != "adapter_model.safetensors":
            return upload(self, src, key, progress)
        self._temp_beside(self._path(key)).write_bytes(src.read_bytes()[:1000])
        print("mid-upload", flush=True)
        time.sleep(600)

    LocalStore.upload = upload_half_of_the_weights

    async def main(tmp: Path, model: Path, source: str) -> None:
        reg = await build_registry(
            RegistrySettings(store=str(tmp / "store")), FakeEngine(), model_dir=model,
            base_model_name="tiny", max_lora_rank=16, max_loras=2, max_cpu_loras=3,
            cache_root=tmp / "cache", metrics_registry=CollectorRegistry(),
        )
        await reg.register("killed", source)

    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
""")


async def test_a_registration_killed_mid_upload_leaves_nothing_after_the_next_start(
    tmp_path: Path, dense_model: Path
) -> None:
    child = subprocess.Popen(  # noqa: ASYNC220 (a child killed at once; nothing awaits it)
        [sys.executable, "-c", KILLED_REGISTRATION, str(tmp_path), str(dense_model),
         str(write_adapter(tmp_path / "src"))],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "mid-upload"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    blobs = tmp_path / "store" / BLOB_PREFIX
    left = sorted(p.name for p in blobs.iterdir())
    assert len(left) == 2 and left[0].startswith(".tmp-")  # as the issue found them
    assert list((tmp_path / "cache" / "disk" / "tmp").iterdir())  # the registration's copy
    reg = await local_registry(tmp_path, dense_model)  # the next start
    await sweep(reg)
    assert list(blobs.iterdir()) == [] and reg.names() == []
    assert list((tmp_path / "cache" / "disk" / "tmp").iterdir()) == []
    assert reg.cache.cached() == set()
