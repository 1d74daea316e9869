"""The adapter registry: the `AdapterSource` the gateway leases from, and the admin operations.

A lease walks an adapter down the tiers: object store -> disk cache -> engine CPU cache, then
holds it until the request ends. Warm adapters cost two dict lookups; a cold one is loaded once
however many requests ask at the same moment (single flight), with the download in a worker
thread, so other streams wait at most for the engine's disk-to-memory load.

Catalog writes (register, rollback, pin, delete, quarantine) append to the shared log; a poll
loop applies what other replicas appended and reconciles the engine tiers with the result.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from loraplex.adapters_registry.base import (
    AdapterError,
    AdapterInvalid,
    AdapterNotFound,
    AdapterUnavailable,
    ServableAdapter,
)
from loraplex.adapters_registry.base_model import BaseModelSpec
from loraplex.adapters_registry.catalog import SNAPSHOT_EVERY, Catalog, VersionRecord, blob_key
from loraplex.adapters_registry.disk_cache import CacheError, DiskCache, HashMismatch
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.names import parse_ref
from loraplex.adapters_registry.quarantine import Quarantines, one_line
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.single_flight import SingleFlight
from loraplex.adapters_registry.store import (
    ContentMismatch,
    ObjectStore,
    StoreError,
)
from loraplex.adapters_registry.tiers import EngineTier, EngineTiers

log = logging.getLogger(__name__)
_APPEND_ATTEMPTS = 20
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


class AdapterRegistry:
    def __init__(
        self,
        settings: RegistrySettings,
        *,
        store: ObjectStore,
        cache: DiskCache,
        tiers: EngineTiers,
        spec: BaseModelSpec,
        max_lora_rank: int,
        metrics: RegistryMetrics,
    ) -> None:
        self.settings = settings
        self.store = store
        self.catalog = Catalog(store)
        self.cache = cache
        self.tiers = tiers
        self.spec = spec
        self.metrics = metrics
        self.max_lora_rank = max_lora_rank
        self._loads: SingleFlight[int, None] = SingleFlight()
        self._fetches: SingleFlight[str, bool] = SingleFlight()
        # Versions a prefetch downloaded that no load has taken from disk yet: that load counts
        # its request's disk miss, not a hit on the files the prefetch put there. A version
        # whose request left before its load stays until its next load: one entry at most.
        self._fetched_ahead: set[str] = set()
        self._unpins: dict[int, asyncio.Task[None]] = {}  # engine id -> unpin under way
        self._retires: dict[int, asyncio.Task[None]] = {}  # engine id -> removal under way
        self.quarantines = Quarantines(self.catalog, metrics)
        self._sync_lock = asyncio.Lock()

    # ---- AdapterSource ----

    def names(self) -> list[str]:
        return self.catalog.names()

    def resolve(self, model: str) -> VersionRecord:
        """The version `model` (`name` or `name@version`) names, if it may serve: raises
        AdapterNotFound, AdapterQuarantined."""
        record = self.lookup(model)
        self.quarantines.check(record, model)
        return record

    def lookup(self, model: str) -> VersionRecord:
        """The version `model` names, quarantined or not (admin); AdapterNotFound otherwise."""
        try:
            ref = parse_ref(model)
        except AdapterInvalid as e:
            raise AdapterNotFound(f"The model `{model}` does not exist.", param="model") from e
        return self.catalog.resolve(ref)

    async def prefetch(self, name: str) -> None:
        """Put `name`'s files on local disk (fetched once however many ask), taking no slot of
        the engine's cache. Raises AdapterNotFound, AdapterUnavailable."""
        record = self.resolve(name)
        # A loaded one needs nothing (the hot path); nor one on disk, which its load counts.
        if self.tiers.tier(record.engine_id) is not None or self.cache.contains(record.version):
            return
        with _unavailable_on_failure(record, "fetched"):  # e.g. the disk is full: a 503
            if await self._on_disk(record):
                self._fetched_ahead.add(record.version)

    @asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[ServableAdapter]:
        record = self.resolve(name)
        engine_id = record.engine_id
        if self.tiers.try_hold(engine_id):
            self.metrics.hits.labels("cpu").inc()
        else:
            self.metrics.misses.labels("cpu").inc()
            await self._hold_cold(record, name)
        try:
            yield self._servable(record)
        finally:
            await self.tiers.release(engine_id)

    def _servable(self, record: VersionRecord) -> ServableAdapter:
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
            self.quarantines.check(record, record.name)  # quarantined during the download
            await self.tiers.load(self._servable(record), record.size_bytes)

    async def _on_disk(self, record: VersionRecord) -> bool:
        """Whether the files had to be fetched (by this call or one it joined)."""
        return await self._fetches.do(record.version, lambda: self._ensure_on_disk(record))

    async def _ensure_on_disk(self, record: VersionRecord) -> bool:
        if self.cache.lookup(record.version) is not None:
            return False
        start = time.perf_counter()

        def get(entry: Any, dest: Path) -> None:
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

    # ---- catalog sync ----

    async def refresh(self) -> None:
        """Apply what the log gained since the last refresh, then reconcile the engine tiers
        with the catalog and with the engine's own list of loaded adapters."""
        async with self._sync_lock:
            await self._refresh_locked()
        await self._record_quarantines()
        extra, lost = await self.tiers.reconcile()
        if extra or lost:
            log.warning("engine tiers disagreed: removed unknown ids %s, forgot lost ids %s",
                        sorted(extra), sorted(lost))  # fmt: skip
        await self._reconcile()

    async def _refresh_locked(self) -> None:
        fetch = self.catalog.fetch_events
        if self.catalog.last_seq == 0:  # a start: the snapshot, then the log after it at once
            snap = await asyncio.to_thread(self.catalog.fetch_snapshot)
            if snap is not None:
                self.catalog.load_snapshot(snap)
            fetch = self.catalog.fetch_tail
        for seq, event in await asyncio.to_thread(fetch):
            self.catalog.apply(seq, event)
        self._publish_counts()

    def _publish_counts(self) -> None:
        self.metrics.registered.set(len(self.catalog))
        self.metrics.quarantined.set(len(self.catalog.quarantined_engine_ids()))

    async def _append(self, plan: Callable[[], dict[str, Any] | None]) -> None:
        """Append the event `plan()` builds from the fresh state; retry when a replica wins."""
        async with self._sync_lock:
            for _ in range(_APPEND_ATTEMPTS):
                await self._refresh_locked()
                event = plan()
                if event is None:
                    return
                seq = self.catalog.last_seq + 1
                try:
                    if not await asyncio.to_thread(self.catalog.write_event, seq, event):
                        continue  # another replica took `seq`: re-plan on its state
                except StoreError as e:
                    raise AdapterUnavailable(
                        f"catalog write to {self.store.uri} failed: {e}"
                    ) from e
                self.catalog.apply(seq, event)
                self._publish_counts()
                if seq % SNAPSHOT_EVERY == 0:
                    await self._write_snapshot()
                return
        raise AdapterUnavailable("catalog is contended by other writers; try again")

    async def _write_snapshot(self) -> None:
        """The event is committed whatever happens here: a snapshot only shortens the log the
        next start reads, so a failed one is logged, not the caller's error."""
        try:
            await asyncio.to_thread(self.catalog.write_snapshot, self.catalog.snapshot())
        except StoreError:
            log.exception("catalog snapshot at %d failed; starts read a longer log until the "
                          "next one", self.catalog.last_seq)  # fmt: skip

    async def _reconcile(self) -> None:
        """Drop engine copies of versions no name reaches any more and of quarantined ones;
        apply replicas' pins (a quarantined version's pin waits for the quarantine to clear)."""
        live = self.catalog.live_engine_ids()
        for engine_id in self.tiers.loaded_ids() - live:
            if self.tiers.leases(engine_id) == 0:
                await self.tiers.evict(engine_id, drain_s=0)
        quarantined = self.quarantines.engine_ids()
        for engine_id in self.tiers.loaded_ids() & quarantined:
            self._start_retire(engine_id)
        wanted = {
            record.engine_id: record
            for record in self.catalog.pinned_records()
            if record.engine_id not in quarantined
        }
        # Unpins first: a pinned name moved to a new version frees its old slot for the new one
        # (at once if no request is in flight on the old one; else when they end).
        for engine_id in wanted.keys() & self._unpins.keys():  # pinned again meanwhile
            self._unpins.pop(engine_id).cancel()
        started = [
            self._start_unpin(engine_id)
            for engine_id in self.tiers.pinned_ids() - wanted.keys() - self._unpins.keys()
        ]
        if started:
            await asyncio.wait(started, timeout=UNPIN_SETTLE_S)
        for engine_id, record in wanted.items():
            if engine_id in self.tiers.pinned_ids():
                continue
            try:
                await self._pin_record(record)
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

    def _start_retire(self, engine_id: int) -> None:
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

    def stop_background(self) -> None:
        """Cancel the unpins and removals still waiting for their adapter to go idle (at
        shutdown)."""
        for task in (*self._unpins.values(), *self._retires.values()):
            task.cancel()

    # ---- quarantine ----

    async def quarantine(self, name: str, version: str, reason: str) -> None:
        """See `AdapterSource.quarantine`: refused here at once, out of the engine once idle,
        then recorded in the catalog (retried at each poll if the store fails)."""
        reason = one_line(reason)
        record = self.catalog.versions(name).get(version)
        if record is None:
            log.warning("quarantine of adapter %s version %s ignored: no such version (%s)",
                        name, version, reason)  # fmt: skip
            return
        self.quarantines.add(record, reason)
        self._start_retire(record.engine_id)
        await self._record_quarantines()

    async def _record_quarantines(self) -> None:
        """Write this replica's quarantines the catalog lacks; one that fails stays for the
        next poll. Never raises (the guard's call must not fail its caller)."""
        for name, version in self.quarantines.unrecorded():
            try:
                await self._append(functools.partial(self.quarantines.event, name, version))
            except (AdapterError, StoreError) as e:
                log.warning("quarantine of adapter %s version %s holds on this replica; the "
                            "catalog write failed and is retried at the next poll: %s",
                            name, version, e)  # fmt: skip
                return
            self.quarantines.forget(name, version)

    async def poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("registry poll of %s failed; retrying", self.store.uri)

    # ---- tier moves shared by the admin operations ----

    async def warm(self, record: VersionRecord) -> None:
        """Make `record` resident in the engine's CPU cache without holding it."""
        if not self.tiers.try_hold(record.engine_id):
            await self._hold_cold(record, record.name)
        await self.tiers.release(record.engine_id)

    async def _pin_record(self, record: VersionRecord) -> None:
        # Hold while pinning so the fresh load is not chosen as an eviction victim meanwhile.
        self.quarantines.check(record, record.name)
        if not self.tiers.try_hold(record.engine_id):
            await self._hold_cold(record, record.name)
        try:
            await self.tiers.pin(record.engine_id)
        finally:
            await self.tiers.release(record.engine_id)

    def tier_of(self, record: VersionRecord) -> str:
        tier = self.tiers.tier(record.engine_id)
        if tier in (EngineTier.GPU, EngineTier.CPU):
            return tier.value
        if self.cache.contains(record.version):
            return "disk"
        # Only in the object store: named after its kind, as operators know it.
        return "s3" if self.store.uri.startswith("s3://") else "store"
