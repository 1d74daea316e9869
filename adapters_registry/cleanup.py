"""Start-up removes what killed processes left behind (a kill -9 mid-registration left a `.tmp-*`
file and a blob no version references in the store).

The disk cache belongs to this process alone (its lock): it empties its own temporary folder
when it opens, and here drops version folders no catalog version references (a registration
killed between installing its files and its catalog write, or a deleted adapter's).

The store may be shared by replicas, and a blob no version references may be one that another
replica is registering right now: uploaded, its catalog write still to come. The rule: a blob no
version references, or a partial write (a local `.tmp-*` file, an S3 multipart upload never
completed), is deleted only if
- no other process uses the store (a local store, whose users each hold a shared flock: this
  process holds it exclusively during the sweep, and others starting meanwhile wait), or
- it has not been modified for `registry.orphan_grace_s` (an hour by default, where
  registrations take minutes), checked again right before its delete; and a registration that
  finds its blob already in the store touches it before relying on it (`publish_blobs`).
What is left: a registration reusing an orphan older than the grace in the milliseconds between
the sweep's last check and its delete. S3 stores are never taken as unused (nothing tells).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from loraplex.adapters_registry.catalog import BLOB_PREFIX
from loraplex.adapters_registry.catalog_sync import CatalogSync
from loraplex.adapters_registry.disk_cache import DiskCache
from loraplex.adapters_registry.local_store import LocalStore
from loraplex.adapters_registry.store import ObjectMissing, ObjectStore, StoreError

log = logging.getLogger(__name__)


@dataclass
class Swept:
    """What a sweep removed: store keys (blobs and partial writes) and cached versions."""

    store: list[str] = field(default_factory=list)
    cache: list[str] = field(default_factory=list)


async def sweep_leftovers(sync: CatalogSync, cache: DiskCache, orphan_grace_s: float) -> Swept:
    """Remove the leftovers of the catalog's store and of the disk cache (module docstring),
    blobs no version references only once `orphan_grace_s` old where other replicas may use the
    store. A store that fails meanwhile is logged: start-up goes on, and the next one sweeps
    again."""
    store = sync.store
    alone = isinstance(store, LocalStore) and await asyncio.to_thread(store.claim_users_lock)
    swept = Swept()
    try:
        grace = 0.0 if alone else orphan_grace_s
        blobs = await asyncio.to_thread(store.list_keys, BLOB_PREFIX)
        await sync.refresh()  # the catalog as of after the listing
        referenced = {BLOB_PREFIX + sha for sha in sync.catalog.referenced_blobs()}
        orphans = [key for key in blobs if key not in referenced]
        swept.store = await asyncio.to_thread(_remove_stale, store, orphans, grace)
        swept.store += await asyncio.to_thread(store.remove_partial_writes, grace)
    except (StoreError, OSError, ValueError) as e:  # a store failing, a file it cannot remove
        log.warning("start-up sweep of %s stopped: %s", store.uri, e)
    finally:
        if isinstance(store, LocalStore):
            await asyncio.to_thread(store.share_users_lock)
    swept.cache = await asyncio.to_thread(cache.retain, sync.catalog.all_versions())
    if swept.store or swept.cache:
        log.info(
            "start-up removed leftovers: %d from %s (%s), %d cached versions no adapter has",
            len(swept.store), store.uri, ", ".join(swept.store[:5]), len(swept.cache),
        )  # fmt: skip
    return swept


def _remove_stale(store: ObjectStore, keys: list[str], grace_s: float) -> list[str]:
    removed = []
    for key in keys:
        try:
            if grace_s and time.time() - store.modified(key) < grace_s:
                continue  # maybe another replica's registration, between upload and catalog
            store.delete(key)
        except ObjectMissing:
            continue
        removed.append(key)
    return removed
