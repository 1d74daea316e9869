"""Turning a source into a version the catalog can name: fetched, validated, hashed, published.

Nothing is registered until all of it is done: the files are fetched into the disk cache's
temporary folder (`sources`: size caps and link rules as they are read), checked against the base
model (`validation`: every field, header and value), hashed (the version is the sha256 over both
files), uploaded to the store under their own hashes, and installed in the disk cache. A failure
at any step leaves the store's catalog and the caches as they were; only then does the admin
operation append the catalog event that names the version.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass

from loraplex.adapters_registry.base import AdapterInvalid, AdapterUnavailable
from loraplex.adapters_registry.base_model import BaseModelSpec
from loraplex.adapters_registry.disk_cache import CacheError, DiskCache, digest_folder
from loraplex.adapters_registry.engine import LoraTargets
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.records import FileEntry
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.sources import fetch_source, publish_blobs
from loraplex.adapters_registry.store import ObjectStore, StoreError
from loraplex.adapters_registry.validation import ADAPTER_FILES, validate_adapter


@dataclass(frozen=True)
class PreparedVersion:
    """A version's files, published to the store and on local disk, not yet in the catalog."""

    version: str
    files: tuple[FileEntry, ...]
    rank: int


@dataclass(frozen=True)
class Registrar:
    settings: RegistrySettings
    spec: BaseModelSpec
    max_lora_rank: int
    store: ObjectStore  # where the version's files are published
    cache: DiskCache  # where they are installed
    metrics: RegistryMetrics
    targets: LoraTargets | None = None  # the engine's lora_target_modules; None: unrestricted

    async def prepare(self, name: str, source: str) -> PreparedVersion:
        """`source`'s adapter as a version for `name` (the module docstring's steps). Raises
        AdapterInvalid (counted by its reason), AdapterUnavailable."""
        tmp = self.cache.new_temp_dir()
        try:
            await asyncio.to_thread(fetch_source, source, tmp, self.settings)
            checked = await asyncio.to_thread(
                validate_adapter, tmp, self.spec, max_lora_rank=self.max_lora_rank,
                allowed_dtypes=set(self.settings.allowed_dtypes),
                max_weight_abs=self.settings.max_weight_abs, targets=self.targets,
            )  # fmt: skip
            version, files = await asyncio.to_thread(digest_folder, tmp, ADAPTER_FILES)
            await asyncio.to_thread(publish_blobs, self.store, tmp, files)
            await asyncio.to_thread(self.cache.install, version, tmp, files)
        except AdapterInvalid as e:
            self.metrics.validation_failures.labels(e.reason).inc()
            raise
        except (StoreError, CacheError) as e:
            raise AdapterUnavailable(f"registering `{name}` failed: {e}", param="source") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return PreparedVersion(version, files, checked.rank)
