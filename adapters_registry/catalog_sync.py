"""This replica's catalog kept in step with the shared log: what it reads, and how it writes.

A refresh applies the entries other replicas appended since the last one (a start: the newest
snapshot, then the log after it). A write refreshes, plans its event on that fresh state and
appends it; when another replica took the sequence number first, it refreshes and plans again,
so an operation is always decided on the state it lands on. Every `SNAPSHOT_EVERY` entries the
writer also stores a snapshot, which a start reads instead of the log before it. Reads and
writes take turns (one lock), on the event loop; the store's I/O runs in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from loraplex.adapters_registry.base import AdapterUnavailable
from loraplex.adapters_registry.catalog import SNAPSHOT_EVERY, Catalog
from loraplex.adapters_registry.events import Event
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.store import StoreError

log = logging.getLogger(__name__)
_APPEND_ATTEMPTS = 20


class CatalogSync:
    def __init__(self, catalog: Catalog, metrics: RegistryMetrics) -> None:
        self.catalog = catalog
        self.store = catalog.store
        self._metrics = metrics
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        """Apply what the log gained since the last refresh. Raises StoreError."""
        async with self._lock:
            await self._read_new()

    async def _read_new(self) -> None:
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
        self._metrics.registered.set(len(self.catalog))
        self._metrics.quarantined.set(len(self.catalog.quarantined_engine_ids()))

    async def append(self, plan: Callable[[], Event | None]) -> None:
        """Append the event `plan()` builds from the fresh state (None: nothing to write);
        `plan` may raise to refuse. Raises AdapterUnavailable when the store fails or other
        writers keep winning."""
        async with self._lock:
            for _ in range(_APPEND_ATTEMPTS):
                await self._read_new()
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
