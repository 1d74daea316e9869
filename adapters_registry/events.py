"""The catalog's events: what one entry of its log says, as typed values, and their JSON form.

A catalog write appends one event, and every replica applies the same events in the same order
(`Catalog.apply`, one `match` over these classes). In the store an event is one JSON object,
`{"op": ..., "name": ..., "at": ..., "id": ..., **fields}`. Replicas of different releases share
one log, so that form does not change, and an `op` this release does not know reads as None
(applied as nothing: a later release's event). `id` is random: a writer whose response was lost
tells its own event from another writer's by it (`Catalog.write_event`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from loraplex.adapters_registry.records import VersionRecord


@dataclass(frozen=True, kw_only=True)
class _Event:
    name: str
    at: float = field(default_factory=time.time)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True, kw_only=True)
class Registered(_Event):
    """`record` is a new version of `name`, which serves it from now on. `pinned`: the name's
    pin after it (a new version of a pinned name keeps the pin); None leaves the pin as it was."""

    record: VersionRecord
    pinned: bool | None = None


@dataclass(frozen=True, kw_only=True)
class Moved(_Event):
    """`name` serves `version`, one it had before; a rollback drops the version it leaves from
    the name's history, so repeated rollbacks walk back."""

    version: str
    rollback: bool = False


@dataclass(frozen=True, kw_only=True)
class PinSet(_Event):
    """`name` is kept in a GPU slot on every replica, or no longer."""

    pinned: bool


@dataclass(frozen=True, kw_only=True)
class Quarantined(_Event):
    """Version `version` of `name` serves no requests, because of `reason`, since `at`."""

    version: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Unquarantined(_Event):
    """Version `version` of `name` serves again."""

    version: str


@dataclass(frozen=True, kw_only=True)
class Deleted(_Event):
    """`name` and its versions are gone; registering the name again starts a fresh history."""


@dataclass(frozen=True, kw_only=True)
class RecordsChanged(_Event):
    """Records another part of the server keeps in this log, under the namespace `name` (the
    tenants: `server/tenancy/store.py`): each key of `changes` takes its value, or is removed
    where the value is None. The catalog keeps the values as they are; their owner checks them."""

    changes: dict[str, Any]


Event = Registered | Moved | PinSet | Quarantined | Unquarantined | Deleted | RecordsChanged

_OPS: dict[str, type[Event]] = {
    "register": Registered,
    "move": Moved,
    "pin": PinSet,
    "quarantine": Quarantined,
    "unquarantine": Unquarantined,
    "delete": Deleted,
    "records": RecordsChanged,
}
_OP_OF = {kind: op for op, kind in _OPS.items()}


def to_json(event: Event) -> dict[str, Any]:
    data = {"op": _OP_OF[type(event)], **asdict(event)}
    if data.get("pinned", False) is None:  # Registered leaving the pin as it was
        del data["pinned"]
    return data


def from_json(data: dict[str, Any]) -> Event | None:
    """The event `data` holds; None for an op this release does not know."""
    common: dict[str, Any] = {
        "name": data["name"], "at": float(data.get("at", 0.0)), "id": str(data.get("id", "")),
    }  # fmt: skip
    match data.get("op"):
        case "register":
            record = VersionRecord.from_json(data["record"])
            pinned = bool(data["pinned"]) if "pinned" in data else None
            return Registered(record=record, pinned=pinned, **common)
        case "move":
            return Moved(version=data["version"], rollback=bool(data.get("rollback")), **common)
        case "pin":
            return PinSet(pinned=bool(data["pinned"]), **common)
        case "quarantine":
            return Quarantined(version=data["version"], reason=str(data["reason"]), **common)
        case "unquarantine":
            return Unquarantined(version=data["version"], **common)
        case "delete":
            return Deleted(**common)
        case "records":
            return RecordsChanged(changes=dict(data["changes"]), **common)
    return None
