"""Quarantined adapter versions as one replica sees them: the catalog's, plus those this replica
quarantined whose catalog write has not landed yet (the store failing, say).

A version is quarantined when the engine guard saw it produce non-finite values, or an admin
says so. The catalog's `Quarantined` event carries it to every replica; until that event is
written, the quarantine still holds here (`unrecorded`), and the registry retries the write at
each poll. Holds state only, on the event loop; the registry does the writes and the engine moves.
"""

from __future__ import annotations

import logging
import time

from loraplex.adapters_registry.base import AdapterQuarantined
from loraplex.adapters_registry.catalog import Catalog, Quarantine, VersionHealth
from loraplex.adapters_registry.events import Quarantined
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.records import VersionRecord

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 200


def one_line(reason: str) -> str:
    """`reason` as one log line of at most MAX_REASON_CHARS characters (control characters,
    newlines among them, become spaces)."""
    flat = "".join(" " if ord(c) < 0x20 or ord(c) == 0x7F else c for c in reason).strip()
    if len(flat) > MAX_REASON_CHARS:
        return flat[: MAX_REASON_CHARS - 3] + "..."
    return flat or "no reason given"


class Quarantines:
    def __init__(self, catalog: Catalog, metrics: RegistryMetrics) -> None:
        self._catalog = catalog
        self._metrics = metrics
        self._unrecorded: dict[tuple[str, str], Quarantine] = {}  # (name, version) -> why

    def of(self, record: VersionRecord) -> Quarantine | None:
        """Why `record` is quarantined, or None if it is healthy."""
        recorded = self._catalog.quarantine_of(record.name, record.version)
        return recorded or self._unrecorded.get((record.name, record.version))

    def health(self, record: VersionRecord) -> VersionHealth:
        return VersionHealth.HEALTHY if self.of(record) is None else VersionHealth.QUARANTINED

    def check(self, record: VersionRecord, model: str) -> None:
        """Raise AdapterQuarantined (naming `model`, as the client sent it) if `record` is."""
        quarantine = self.of(record)
        if quarantine is not None:
            raise AdapterQuarantined(
                f"The model `{model}` is quarantined and serves no requests: "
                f"{quarantine.reason}. An administrator must register a new version, roll it "
                "back or clear the quarantine.",
                param="model",
            )

    def engine_ids(self) -> set[int]:
        unrecorded = {
            self._catalog.versions(name)[version].engine_id
            for name, version in self._unrecorded
            if version in self._catalog.versions(name)
        }
        return self._catalog.quarantined_engine_ids() | unrecorded

    def add(self, record: VersionRecord, reason: str) -> bool:
        """Quarantine `record` on this replica at once (counted and logged); False if it was."""
        if self.of(record) is not None:
            return False
        self._unrecorded[(record.name, record.version)] = Quarantine(reason, time.time())
        self._metrics.quarantines.inc()
        log.warning(
            "adapter %s version %s (engine id %d) quarantined: %s",
            record.name, record.version, record.engine_id, reason,
        )  # fmt: skip
        return True

    def unrecorded(self) -> list[tuple[str, str]]:
        return list(self._unrecorded)

    def event(self, name: str, version: str) -> Quarantined | None:
        """The catalog event recording this replica's quarantine of (name, version), or None
        when the catalog needs none (recorded already, or the version is gone)."""
        quarantine = self._unrecorded.get((name, version))
        if quarantine is None or version not in self._catalog.versions(name):
            return None
        if self._catalog.health(name, version) is VersionHealth.QUARANTINED:
            return None
        return Quarantined(name=name, version=version, reason=quarantine.reason, at=quarantine.at)

    def forget(self, name: str, version: str) -> None:
        """Drop this replica's own record (the catalog has it, or an admin cleared it)."""
        self._unrecorded.pop((name, version), None)
