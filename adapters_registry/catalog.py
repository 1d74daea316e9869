"""The catalog: which adapter names exist and which immutable version each one serves.

It is an append-only log of events kept in the object store itself, one object per event at
`catalog/log/<seq>.json`, each written with exclusive creation. Two replicas that append at once
race for the same sequence number; the loser re-reads the log and tries again, so every replica
applies the same events in the same order and converges. Each event carries a random id: a write
whose response was lost is retried by the S3 client and refused as taken, and the id tells the
writer that the event there is its own (re-planning would apply it twice). A snapshot of the whole
state is written every `SNAPSHOT_EVERY` events so a start reads one snapshot plus a short tail, not
the whole log.

Other parts of the server keep small records in the same log (`RecordsChanged`, `records`: the
tenants), so that a replica's one poll follows them too: idle, one GET whatever they hold.

Engine ids are allocated by the log (one more than the largest ever given), so an id names exactly
one version's bytes for the life of the store, across restarts and replicas.

The events are typed (`events`). A version's health is in the log too: `Quarantined` takes one
version out of service on every replica (its bytes made the engine produce non-finite values,
say), `Unquarantined` puts it back. Registering new bytes under the name moves the name to a new,
healthy version.

This class holds state only; it does no I/O except through the `fetch_*`/`write_*` methods, which
block and are run in threads. `apply` mutates and must be called on one task at a time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, assert_never

from loraplex.adapters_registry.base import AdapterInvalid, AdapterNotFound
from loraplex.adapters_registry.events import (
    Deleted,
    Event,
    Moved,
    PinSet,
    Quarantined,
    RecordsChanged,
    Registered,
    Unquarantined,
    from_json,
    to_json,
)
from loraplex.adapters_registry.names import AdapterRef
from loraplex.adapters_registry.records import VersionRecord
from loraplex.adapters_registry.store import (
    ObjectExists,
    ObjectMissing,
    ObjectStore,
    StoreUnavailable,
)

LOG_PREFIX = "catalog/log/"
SNAPSHOT_PREFIX = "catalog/snapshot/"
SNAPSHOT_EVERY = 256
# Waits before each read of a log entry whose write was refused as conflicting, for the other
# write to land (`Catalog._settled_event`): reads at 0, 0.1, 0.3, 0.7, 1.5 and 3.1 s.
WRITE_SETTLE_DELAYS_S = (0.0, 0.1, 0.2, 0.4, 0.8, 1.6)
# Log entries a start reads at once (`Catalog.fetch_tail`): a 232-entry tail from moto, 2.3 s one
# by one, took 1.2 s 8 at a time (docs/architecture.md); S3Store pools 16 connections.
TAIL_READERS = 8
BLOB_PREFIX = "blobs/sha256/"

log = logging.getLogger(__name__)


def log_key(seq: int) -> str:
    return f"{LOG_PREFIX}{seq:012d}.json"


def blob_key(sha256: str) -> str:
    return BLOB_PREFIX + sha256


class VersionHealth(Enum):
    """Whether a version may serve requests (the catalog's word, the same on every replica)."""

    HEALTHY = "healthy"
    QUARANTINED = "quarantined"  # refused to requests until unquarantined; kept for rollback


@dataclass(frozen=True)
class Quarantine:
    """Why and when a version was taken out of service."""

    reason: str
    at: float


@dataclass
class NameEntry:
    """Where a name points now, and the versions it pointed to before (oldest first)."""

    name: str
    version: str
    history: list[str] = field(default_factory=list)
    pinned: bool = False
    updated_at: float = 0.0


class Catalog:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.last_seq = 0
        self._versions: dict[str, dict[str, VersionRecord]] = {}
        self._names: dict[str, NameEntry] = {}
        self._quarantined: dict[str, dict[str, Quarantine]] = {}  # name -> version -> why
        self._max_engine_id = 0
        self._records: dict[str, dict[str, Any]] = {}  # namespace -> key -> value
        # What every poll's reconcile asks for, kept until the next change: rebuilding both from
        # 10,000 names took 5.7 ms of the event loop a poll.
        self._live_ids: frozenset[int] | None = None
        self._pinned: tuple[VersionRecord, ...] | None = None

    # ---- reads (event loop, no I/O) ----

    def __len__(self) -> int:
        """How many names are registered."""
        return len(self._names)

    def names(self) -> list[str]:
        return sorted(self._names)

    def entry(self, name: str) -> NameEntry | None:
        return self._names.get(name)

    def is_pinned(self, name: str) -> bool:
        entry = self._names.get(name)
        return entry is not None and entry.pinned

    def versions(self, name: str) -> dict[str, VersionRecord]:
        return self._versions.get(name, {})

    def health(self, name: str, version: str) -> VersionHealth:
        if version in self._quarantined.get(name, {}):
            return VersionHealth.QUARANTINED
        return VersionHealth.HEALTHY

    def quarantine_of(self, name: str, version: str) -> Quarantine | None:
        return self._quarantined.get(name, {}).get(version)

    def quarantined_engine_ids(self) -> set[int]:
        return {
            self._versions[name][version].engine_id
            for name, versions in self._quarantined.items()
            for version in versions
        }

    def next_engine_id(self) -> int:
        return self._max_engine_id + 1

    def resolve(self, ref: AdapterRef) -> VersionRecord:
        """The version `ref` names. Raises AdapterNotFound (unknown or deleted name/version)."""
        entry = self._names.get(ref.name)
        if entry is None:
            raise AdapterNotFound(f"The model `{ref.name}` does not exist.", param="model")
        versions = self._versions[ref.name]
        if ref.version is None:
            return versions[entry.version]
        record = versions.get(ref.version)
        if record is not None:
            return record
        matches = [v for v in versions if v.startswith(ref.version)]
        if len(matches) > 1:
            raise AdapterInvalid(
                f"version prefix {ref.version!r} of `{ref.name}` is ambiguous", param="model"
            )
        if not matches:
            raise AdapterNotFound(
                f"The model `{ref.name}@{ref.version}` does not exist.", param="model"
            )
        return versions[matches[0]]

    def all_versions(self) -> set[str]:
        """Every version any name has (current or in its history)."""
        return {v for versions in self._versions.values() for v in versions}

    def referenced_blobs(self) -> set[str]:
        """The sha256 of every file of every version any name has."""
        return {f.sha256 for vs in self._versions.values() for r in vs.values() for f in r.files}

    def live_engine_ids(self) -> frozenset[int]:
        """Engine ids of every version still reachable by a registered name."""
        if self._live_ids is None:
            self._live_ids = frozenset(
                r.engine_id for n in self._names for r in self._versions.get(n, {}).values()
            )
        return self._live_ids

    def pinned_records(self) -> tuple[VersionRecord, ...]:
        """The current version of every pinned name."""
        if self._pinned is None:
            self._pinned = tuple(
                self._versions[name][entry.version]
                for name, entry in self._names.items()
                if entry.pinned
            )
        return self._pinned

    def records(self, namespace: str) -> Mapping[str, Any] | None:
        """The records kept under `namespace` (`RecordsChanged`), None if it was never written.
        A new mapping after every change to it, never mutated: a reader holding one tells a
        change by identity."""
        return self._records.get(namespace)

    # ---- mutation (one task at a time) ----

    def apply(self, seq: int, event: Event | None) -> None:
        """Apply event `seq` (None: an op this release does not know, skipped)."""
        self._live_ids = self._pinned = None
        match event:
            case Registered(name=name, record=record, pinned=pinned, at=at):
                self._versions.setdefault(name, {})[record.version] = record
                self._max_engine_id = max(self._max_engine_id, record.engine_id)
                self._move(name, record.version, at)
                if pinned is not None:
                    self._names[name].pinned = pinned
            case Moved(name=name, version=version, rollback=rollback, at=at):
                # Only to a version the name has: a rollback planned on a replica's stale state
                # could name one deleted meanwhile, which resolve() cannot serve.
                if version in self._versions.get(name, {}):
                    self._move(name, version, at, rollback=rollback)
                else:
                    log.warning("catalog event %d moves `%s` to unknown version %s: ignored",
                                seq, name, version)  # fmt: skip
            case PinSet(name=name, pinned=pinned):
                if name in self._names:
                    self._names[name].pinned = pinned
            case Quarantined(name=name, version=version, reason=reason, at=at):
                if version in self._versions.get(name, {}):
                    why = Quarantine(reason, at)
                    self._quarantined.setdefault(name, {}).setdefault(version, why)
            case Unquarantined(name=name, version=version):
                versions = self._quarantined.get(name, {})
                versions.pop(version, None)
                if not versions:
                    self._quarantined.pop(name, None)
            case Deleted(name=name):
                # Its versions go too: a later registration of the name starts a fresh history
                # and gets fresh engine ids (`_max_engine_id` remembers every id ever given).
                self._names.pop(name, None)
                self._versions.pop(name, None)
                self._quarantined.pop(name, None)
            case RecordsChanged(name=namespace, changes=changes):
                records = dict(self._records.get(namespace, {}))
                for key, value in changes.items():
                    if value is None:
                        records.pop(key, None)
                    else:
                        records[key] = value
                self._records[namespace] = records
            case None:
                pass
            case _:
                assert_never(event)
        self.last_seq = seq

    def _move(self, name: str, version: str, at: float, rollback: bool = False) -> None:
        entry = self._names.get(name)
        if entry is None:
            self._names[name] = NameEntry(name, version, [], False, at)
            return
        if rollback:
            # The version rolled back from is dropped from history, so repeated rollbacks walk back.
            if entry.history and entry.history[-1] == version:
                entry.history.pop()
        elif entry.version != version:
            entry.history.append(entry.version)
        entry.version, entry.updated_at = version, at

    # ---- store I/O (blocking: run in a thread) ----

    def fetch_snapshot(self) -> dict[str, Any] | None:
        keys = self.store.list_keys(SNAPSHOT_PREFIX)
        return json.loads(self.store.get_bytes(keys[-1])) if keys else None

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        self._live_ids = self._pinned = None
        for d in snap["versions"]:
            record = VersionRecord.from_json(d)
            self._versions.setdefault(record.name, {})[record.version] = record
            self._max_engine_id = max(self._max_engine_id, record.engine_id)
        self._names = {n["name"]: NameEntry(**n) for n in snap["names"]}
        for q in snap.get("quarantined", []):  # absent from snapshots older than quarantines
            if q["version"] in self._versions.get(q["name"], {}):
                self._quarantined.setdefault(q["name"], {})[q["version"]] = Quarantine(
                    q["reason"], q["at"]
                )
        # Absent from snapshots older than records.
        self._records = {ns: dict(records) for ns, records in snap.get("records", {}).items()}
        self._max_engine_id = max(self._max_engine_id, int(snap["max_engine_id"]))
        self.last_seq = int(snap["seq"])
        self._drop_dangling_versions()

    def _drop_dangling_versions(self) -> None:
        """A snapshot may point a name at a version it does not have (replicas that did not check
        moves wrote such): back to the last one its history has, or the name goes."""
        for name, entry in list(self._names.items()):
            versions = self._versions.get(name, {})
            if entry.version in versions:
                continue
            known = [v for v in entry.history if v in versions]
            if known:
                log.warning("catalog snapshot points `%s` at unknown version %s: back to %s",
                            name, entry.version, known[-1])  # fmt: skip
                entry.version, entry.history = known[-1], known[:-1]
            else:
                log.warning("catalog snapshot points `%s` at unknown version %s and has no "
                            "other: dropped", name, entry.version)  # fmt: skip
                del self._names[name]
                self._versions.pop(name, None)
                self._quarantined.pop(name, None)

    def fetch_events(self) -> list[tuple[int, Event | None]]:
        """Events after `last_seq` in order, stopping at the first gap (a write not yet seen),
        read by key one at a time: what a poll does.

        A poll costs one GET per new entry and one answered 404, however long the log: a LIST
        makes S3 pass over the bucket's keys (moto: 50 ms of its CPU at 10,000 adapters). S3
        answers a missing key with 404, not 403, only to callers allowed s3:ListBucket, which
        `fetch_snapshot` needs anyway."""
        events = []
        seq = self.last_seq + 1
        while (event := self._fetch_event(seq)) is not None:
            events.append((seq, from_json(event)))
            seq += 1
        return events

    def fetch_tail(self) -> list[tuple[int, Event | None]]:
        """The same events, listed once and read `TAIL_READERS` at a time: what a start does,
        whose tail after the snapshot holds up to `SNAPSHOT_EVERY` - 1 entries."""
        seqs: list[int] = []
        for key in self.store.list_keys(LOG_PREFIX, start_after=log_key(self.last_seq)):
            seq = int(key[len(LOG_PREFIX) :].removesuffix(".json"))
            if seq != self.last_seq + 1 + len(seqs):
                break
            seqs.append(seq)
        events = []
        with ThreadPoolExecutor(TAIL_READERS) as pool:
            for seq, event in zip(seqs, pool.map(self._fetch_event, seqs), strict=True):
                if event is None:
                    break
                events.append((seq, from_json(event)))
        return events

    def _fetch_event(self, seq: int) -> dict[str, Any] | None:
        """Event `seq` as stored, or None if it is not there (yet)."""
        try:
            return dict(json.loads(self.store.get_bytes(log_key(seq))))
        except ObjectMissing:
            return None

    def write_event(self, seq: int, event: Event) -> bool:
        """Append `event` as number `seq`: True once it is there, False if another writer took
        `seq`. Number `seq` taken by this very event (a retried write) counts as written."""
        try:
            self.store.put_bytes(log_key(seq), json.dumps(to_json(event)).encode(), if_absent=True)
        except ObjectExists as conflict:
            stored = self._settled_event(seq)
            if stored is None:  # failed, or still coming: whose it is cannot be told yet
                raise StoreUnavailable(
                    f"{log_key(seq)}: a conflicting write has not landed after "
                    f"{sum(WRITE_SETTLE_DELAYS_S):.1f} s"
                ) from conflict
            return bool(stored.get("id")) and stored.get("id") == event.id
        return True

    def _settled_event(self, seq: int) -> dict[str, Any] | None:
        """Event `seq` once a write refused as conflicting has settled. S3 answers 409
        (ConditionalRequestConflict) while another conditional write of the key is in progress,
        which may be this writer's own earlier attempt (a retried PUT): wait for it to land
        before comparing ids. None if it never does."""
        for delay in WRITE_SETTLE_DELAYS_S:
            time.sleep(delay)
            if (event := self._fetch_event(seq)) is not None:
                return event
        return None

    def snapshot(self) -> dict[str, Any]:
        return {
            "seq": self.last_seq,
            "max_engine_id": self._max_engine_id,
            "versions": [asdict(r) for vs in self._versions.values() for r in vs.values()],
            "names": [asdict(e) for e in self._names.values()],
            "quarantined": [
                {"name": name, "version": version, **asdict(q)}
                for name, versions in self._quarantined.items()
                for version, q in versions.items()
            ],
            "records": self._records,
        }

    def write_snapshot(self, snap: dict[str, Any]) -> None:
        key = f"{SNAPSHOT_PREFIX}{snap['seq']:012d}.json"
        self.store.put_bytes(key, json.dumps(snap).encode(), if_absent=False)
