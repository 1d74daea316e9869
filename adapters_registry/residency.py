"""Where this replica holds each adapter version: the disk cache and the engine's tiers.

A lease walks a version down the tiers (object store -> disk cache -> engine CPU cache) and holds
it there until the request ends. Warm versions cost two dict lookups; a cold one is fetched and
loaded once however many requests ask at the same moment (single flight per version, the download
in a worker thread), so other streams wait at most for the engine's disk-to-memory load. A
prefetch puts the files on disk only, holding nothing in the engine.

`drop_unreachable` and `match_catalog` move the engine to what the catalog asks: versions no name
reaches leave it, and so do quarantined ones once idle (retired, in a task); pinned names'
versions are pinned, others unpinned (in a task: an unpin waits for a moment with no request in
flight).

Versions are resolved by the caller; a quarantined one is refused here too, right before each
hold, since it may be quarantined while it loads, and so is one with LoRA on a module the engine's
`lora_target_modules` leave unwrapped, before its load. Runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.adapters_registry.base import (
    AdapterError,
    AdapterNotApplied,
    AdapterUnavailable,
    ServableAdapter,
)
from loraplex.adapters_registry.catalog import blob_key
from loraplex.adapters_registry.disk_cache import CacheError, DiskCache, HashMismatch
from loraplex.adapters_registry.engine import LoraTargets
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.quarantine import Quarantines
from loraplex.adapters_registry.records import FileEntry, VersionRecord
from loraplex.adapters_registry.single_flight import SingleFlight
from loraplex.adapters_registry.store import ContentMismatch, ObjectStore, StoreError
from loraplex.adapters_registry.tiers import EngineTier, EngineTiers
from loraplex.adapters_registry.validation import WEIGHTS_FILE, untargeted_module

log = logging.getLogger(__name__)
_FETCH_ATTEMPTS = 2  # a body that fails its hash is fetched once more before giving up
# How long a reconcile waits for the unpins it starts: an adapter with no request in flight is
# removed and added back from local disk well within it, so the admin call that unpinned it
# answers with it unpinned; one with requests in flight finishes in the background.
UNPIN_SETTLE_S = 5.0


@contextmanager
def _unavailable_on_failure(record: VersionRecord, doing: str) -> Iterator[None]:
    """Any failure in the block but the registry's own as AdapterUnavailable (a 503 naming the
    adapter)."""
    try:
        yield
    except AdapterError:
        raise
    except Exception as e:
        raise AdapterUnavailable(
            f"adapter `{record.name}` could not be {doing}: {e}", param="model"
        ) from e


@dataclass(eq=False)
class Residency:
    tiers: EngineTiers
    cache: DiskCache
    store: ObjectStore  # where versions are fetched from
    quarantines: Quarantines  # refused right before each hold
    metrics: RegistryMetrics
    # The engine's lora_target_modules: a version is checked against them before each load (it
    # may have been registered before them, or by a replica without them). None: unrestricted.
    targets: LoraTargets | None = None
    _loads: SingleFlight[int, None] = field(default_factory=SingleFlight, init=False)
    _fetches: SingleFlight[str, bool] = field(default_factory=SingleFlight, init=False)
    # Versions a prefetch downloaded that no load has taken from disk yet: that load counts
    # its request's disk miss, not a hit on the files the prefetch put there. A version whose
    # request left before its load stays until its next load: one entry at most.
    _fetched_ahead: set[str] = field(default_factory=set, init=False)
    # Version -> the first module of it the engine leaves unwrapped (None: all wrapped), once
    # checked against `targets`.
    _untargeted: dict[str, str | None] = field(default_factory=dict, init=False)
    # Engine id -> unpin, and -> removal, under way.
    _unpins: dict[int, asyncio.Task[None]] = field(default_factory=dict, init=False)
    _retires: dict[int, asyncio.Task[None]] = field(default_factory=dict, init=False)

    # ---- the gateway's side ----

    async def prefetch(self, record: VersionRecord) -> None:
        """Put `record`'s files on local disk, taking no slot of the engine's cache."""
        # A loaded one needs nothing (the hot path); nor one on disk, which its load counts.
        if self.tiers.tier(record.engine_id) is not None or self.cache.contains(record.version):
            return
        with _unavailable_on_failure(record, "fetched"):  # e.g. the disk is full: a 503
            if await self._on_disk(record):
                self._fetched_ahead.add(record.version)

    @asynccontextmanager
    async def lease(self, record: VersionRecord, model: str) -> AsyncIterator[ServableAdapter]:
        """Hold `record` in the engine for the block; `model` is the name the client sent."""
        engine_id = record.engine_id
        if self.tiers.try_hold(engine_id):
            self.metrics.hits.labels("cpu").inc()
        else:
            self.metrics.misses.labels("cpu").inc()
            await self._hold_cold(record, model)
        try:
            yield self.servable(record)
        finally:
            await self.tiers.release(engine_id)

    def servable(self, record: VersionRecord) -> ServableAdapter:
        return ServableAdapter(
            name=record.name,
            version=record.version,
            engine_id=record.engine_id,
            path=self.cache.path(record.version),
            rank=record.rank,
        )

    async def _hold_cold(self, record: VersionRecord, model: str) -> None:
        # A load can finish and be evicted again before this task resumes when more adapters
        # than CPU slots are wanted at once; loop until the hold sticks. The version may be
        # quarantined while it loads: checked right before each hold, with no await between.
        while True:
            self.quarantines.check(record, model)
            if self.tiers.try_hold(record.engine_id):
                return
            await self._loads.do(record.engine_id, lambda: self._make_resident(record))

    async def _make_resident(self, record: VersionRecord) -> None:
        # In use from before the disk lookup: another download making room between the lookup
        # (or this fetch) and the engine's load could otherwise evict the folder it loads.
        with _unavailable_on_failure(record, "loaded"), self.cache.in_use(record.version):
            fetched = await self._on_disk(record)
            if fetched or record.version in self._fetched_ahead:
                self._fetched_ahead.discard(record.version)
                self.metrics.misses.labels("disk").inc()
            else:
                self.metrics.hits.labels("disk").inc()
            await self._check_applied(record)
            # With no await between it and the load: quarantined during the download or check.
            self.quarantines.check(record, record.name)
            await self.tiers.load(self.servable(record), record.size_bytes)

    async def _check_applied(self, record: VersionRecord) -> None:
        """Refuse a version this engine would serve without part of its LoRA (`targets`)."""
        if self.targets is None:
            return
        if record.version not in self._untargeted:  # a version's bytes never change
            weights = self.cache.path(record.version) / WEIGHTS_FILE
            found = await asyncio.to_thread(untargeted_module, weights, self.targets)
            self._untargeted[record.version] = found
        module = self._untargeted[record.version]
        if module is not None:
            raise AdapterNotApplied(
                f"adapter `{record.name}` has LoRA on module `{module}`, which this server's "
                f"engine does not apply (lora_target_modules {list(self.targets.modules)}): it "
                "would be served without that LoRA. Register a version without it, or serve it "
                "from an engine that targets the module.",
                param="model",
            )

    async def _on_disk(self, record: VersionRecord) -> bool:
        """Whether the files had to be fetched (by this call or one it joined)."""
        return await self._fetches.do(record.version, lambda: self._ensure_on_disk(record))

    async def _ensure_on_disk(self, record: VersionRecord) -> bool:
        if self.cache.lookup(record.version) is not None:
            return False
        start = time.perf_counter()

        def get(entry: FileEntry, dest: Path) -> None:
            self.store.download(blob_key(entry.sha256), dest)

        for attempt in range(_FETCH_ATTEMPTS):
            try:
                await asyncio.to_thread(self.cache.fetch, record.version, record.files, get)
                break
            except (StoreError, CacheError) as e:
                self.metrics.load_failures.labels("disk").inc()
                # Bytes that failed their hash may be right the next time; a cache too full
                # or too small will not be.
                retryable = isinstance(e, HashMismatch | ContentMismatch)
                if not retryable or attempt == _FETCH_ATTEMPTS - 1:
                    raise AdapterUnavailable(
                        f"adapter `{record.name}` is unavailable: fetching it from "
                        f"{self.store.uri} failed: {e}",
                        param="model",
                    ) from e
        self.metrics.load_seconds.labels("disk").observe(time.perf_counter() - start)
        return True

    # ---- the operators' side ----

    async def warm(self, record: VersionRecord) -> None:
        """Make `record` resident in the engine's CPU cache without holding it."""
        if not self.tiers.try_hold(record.engine_id):
            await self._hold_cold(record, record.name)
        await self.tiers.release(record.engine_id)

    async def pin(self, record: VersionRecord) -> None:
        """Load `record` and pin it to a GPU slot. Raises AdapterConflict past the pin limit,
        AdapterQuarantined for a quarantined version."""
        # Hold while pinning so the fresh load is not chosen as an eviction victim meanwhile.
        self.quarantines.check(record, record.name)
        if not self.tiers.try_hold(record.engine_id):
            await self._hold_cold(record, record.name)
        try:
            await self.tiers.pin(record.engine_id)
        finally:
            await self.tiers.release(record.engine_id)

    async def unload(self, record: VersionRecord, drain_s: float) -> bool:
        """Take `record` out of the engine once no request holds it (waiting up to `drain_s`);
        False if requests still held it then. True if it was not in the engine."""
        if self.tiers.tier(record.engine_id) is None:
            return True
        return await self.tiers.evict(record.engine_id, drain_s)

    def tier_of(self, record: VersionRecord) -> str:
        """The fastest tier holding `record` here: gpu, cpu, disk, or the store's kind."""
        tier = self.tiers.tier(record.engine_id)
        if tier in (EngineTier.GPU, EngineTier.CPU):
            return tier.value
        if self.cache.contains(record.version):
            return "disk"
        # Only in the object store: named after its kind, as operators know it.
        return "s3" if self.store.uri.startswith("s3://") else "store"

    # ---- following the catalog ----

    async def drop_unreachable(self, live: frozenset[int]) -> None:
        """Drop idle engine copies of versions no name reaches (`live`: those some name does)."""
        for engine_id in self.tiers.loaded_ids() - live:
            if self.tiers.leases(engine_id) == 0:
                await self.tiers.evict(engine_id, drain_s=0)

    async def match_catalog(
        self, quarantined: set[int], pinned: Mapping[int, VersionRecord]
    ) -> None:
        """Retire the `quarantined` versions; pin the `pinned` ones (engine id -> record) and
        unpin the rest."""
        for engine_id in self.tiers.loaded_ids() & quarantined:
            self.retire(engine_id)
        # Unpins first: a pinned name moved to a new version frees its old slot for the new one
        # (at once if no request is in flight on the old one; else when they end).
        for engine_id in pinned.keys() & self._unpins.keys():  # pinned again meanwhile
            self._unpins.pop(engine_id).cancel()
        started = [
            self._start_unpin(engine_id)
            for engine_id in self.tiers.pinned_ids() - pinned.keys() - self._unpins.keys()
        ]
        if started:
            await asyncio.wait(started, timeout=UNPIN_SETTLE_S)
        for engine_id, record in pinned.items():
            if engine_id in self.tiers.pinned_ids():
                continue
            try:
                await self.pin(record)
            except AdapterError as e:  # one bad pin must not stop the others or the poll
                log.warning("cannot pin `%s` on this replica: %s", record.name, e.message)

    def _start_unpin(self, engine_id: int) -> asyncio.Task[None]:
        async def unpin() -> None:
            try:
                await self.tiers.unpin(engine_id)
            except Exception as e:  # unpinned, but not added back: the next request loads it
                log.warning("unpinned engine id %d was not added back to the CPU cache: %s",
                            engine_id, e)  # fmt: skip
            finally:
                if self._unpins.get(engine_id) is task:
                    del self._unpins[engine_id]

        task = asyncio.create_task(unpin(), name=f"unpin-{engine_id}")
        self._unpins[engine_id] = task
        return task

    def retire(self, engine_id: int) -> None:
        """Remove `engine_id` from the engine once its leases end, in a task (idempotent)."""
        if engine_id in self._retires:
            return

        async def retire() -> None:
            try:
                await self.tiers.retire(engine_id)
            except Exception as e:  # the engine's own failure; the next reconcile tries again
                log.warning("quarantined engine id %d was not removed from the engine: %s",
                            engine_id, e)  # fmt: skip
            finally:
                del self._retires[engine_id]

        self._retires[engine_id] = asyncio.create_task(retire(), name=f"retire-{engine_id}")

    def stop(self) -> None:
        """Cancel the unpins and removals still waiting for their adapter to go idle (at
        shutdown)."""
        for task in (*self._unpins.values(), *self._retires.values()):
            task.cancel()
