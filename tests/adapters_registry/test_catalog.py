"""The catalog log: replay, versions, rollback history, snapshots, and racing writers on S3."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loraplex.adapters_registry import catalog as catalog_module
from loraplex.adapters_registry import events as ev
from loraplex.adapters_registry.base import AdapterInvalid, AdapterNotFound
from loraplex.adapters_registry.catalog import Catalog, VersionHealth
from loraplex.adapters_registry.local_store import LocalStore
from loraplex.adapters_registry.names import AdapterRef, check_name, parse_ref
from loraplex.adapters_registry.records import FileEntry, VersionRecord
from loraplex.adapters_registry.s3_store import S3Store
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.store import ObjectExists, ObjectMissing, StoreUnavailable


def record(name: str, version: str, engine_id: int) -> VersionRecord:
    files = (FileEntry("adapter_config.json", "c" * 64, 10),)
    return VersionRecord(name, version, engine_id, 8, files, "base", "s3://x/y", 0.0)


def registered(r: VersionRecord, pinned: bool) -> ev.Registered:
    return ev.Registered(name=r.name, record=r, pinned=pinned)


def append(cat: Catalog, event: ev.Event) -> int:
    seq = cat.last_seq + 1
    assert cat.write_event(seq, event)
    cat.apply(seq, event)
    return seq


def replay(store: LocalStore | S3Store) -> Catalog:
    """A start's read: the snapshot, then the log after it."""
    cat = Catalog(store)
    snap = cat.fetch_snapshot()
    if snap:
        cat.load_snapshot(snap)
    for seq, event in cat.fetch_tail():
        cat.apply(seq, event)
    return cat


def test_register_move_rollback_delete_replay(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    cat = Catalog(store)
    v1, v2 = "a" * 64, "b" * 64
    append(cat, registered(record("acme/bot", v1, 1), pinned=False))
    append(cat, registered(record("acme/bot", v2, 2), pinned=True))
    assert cat.resolve(AdapterRef("acme/bot")).version == v2
    assert cat.resolve(AdapterRef("acme/bot", "aaaaaaaa")).engine_id == 1
    append(cat, ev.Moved(name="acme/bot", version=v1, rollback=True))
    again = replay(store)
    for c in (cat, again):
        entry = c.entry("acme/bot")
        assert entry is not None and entry.version == v1 and entry.history == [] and entry.pinned
        assert c.next_engine_id() == 3
    append(cat, ev.Deleted(name="acme/bot"))
    with pytest.raises(AdapterNotFound):
        replay(store).resolve(AdapterRef("acme/bot"))
    assert replay(store).next_engine_id() == 3  # ids are never handed out twice


def test_pins_and_live_ids_follow_every_change(tmp_path: Path) -> None:
    """Kept between changes (every poll asks), so each kind of change must renew them."""
    cat = Catalog(LocalStore(tmp_path))
    v1, v2 = "a" * 64, "b" * 64

    def pinned() -> list[tuple[str, int]]:
        return sorted((r.name, r.engine_id) for r in cat.pinned_records())

    append(cat, registered(record("x", v1, 1), pinned=True))
    append(cat, registered(record("y", v1, 2), pinned=False))
    assert pinned() == [("x", 1)] and cat.live_engine_ids() == {1, 2} and len(cat) == 2
    append(cat, registered(record("x", v2, 3), pinned=True))
    assert pinned() == [("x", 3)] and cat.live_engine_ids() == {1, 2, 3}
    append(cat, ev.PinSet(name="y", pinned=True))
    append(cat, ev.Moved(name="x", version=v1, rollback=True))
    assert pinned() == [("x", 1), ("y", 2)]
    snap = cat.snapshot()
    append(cat, ev.Deleted(name="x"))
    assert pinned() == [("y", 2)] and cat.live_engine_ids() == {2} and len(cat) == 1
    cat.load_snapshot(snap)
    assert pinned() == [("x", 1), ("y", 2)] and cat.live_engine_ids() == {1, 2, 3}


def test_ambiguous_version_prefix(tmp_path: Path) -> None:
    cat = Catalog(LocalStore(tmp_path))
    append(cat, registered(record("bot", "abcdef12" + "0" * 56, 1), pinned=False))
    append(cat, registered(record("bot", "abcdef12" + "1" * 56, 2), pinned=False))
    with pytest.raises(AdapterInvalid, match="ambiguous"):
        cat.resolve(AdapterRef("bot", "abcdef12"))
    assert cat.resolve(AdapterRef("bot", "abcdef121")).engine_id == 2
    with pytest.raises(AdapterNotFound):
        cat.resolve(AdapterRef("bot", "cdcdcdcd"))


def test_snapshot_then_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog_module, "SNAPSHOT_EVERY", 2)
    store = LocalStore(tmp_path)
    cat = Catalog(store)
    for i in range(1, 4):
        append(cat, registered(record(f"bot{i}", f"{i}" * 64, i), pinned=False))
        if cat.last_seq == 2:
            cat.write_snapshot(cat.snapshot())
    for key in store.list_keys("catalog/log/"):
        if key <= catalog_module.log_key(2):
            (tmp_path / key).unlink()  # a reader must not need the compacted events
    again = replay(store)
    assert again.names() == ["bot1", "bot2", "bot3"] and again.next_engine_id() == 4


class _CountingS3Store(S3Store):
    """The S3 store, counting the reads the catalog makes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gets = self.lists = 0

    def get_bytes(self, key: str) -> bytes:
        self.gets += 1
        return super().get_bytes(key)

    def list_keys(self, prefix: str, start_after: str = "", *, nested: bool = True) -> list[str]:
        self.lists += 1
        return super().list_keys(prefix, start_after, nested=nested)


def test_a_start_lists_the_log_once_and_a_poll_never(bucket: str, s3_endpoint: str) -> None:
    settings = RegistrySettings(s3_endpoint_url=s3_endpoint)
    writer = Catalog(S3Store(bucket, "polled", settings))
    for i in range(1, 21):
        append(writer, registered(record(f"bot{i}", f"{i:064x}", i), pinned=False))
    store = _CountingS3Store(bucket, "polled", settings)
    follower = replay(store)  # the tail of 20 entries, read 8 at a time
    assert follower.names() == writer.names() and follower.last_seq == 20
    assert (store.gets, store.lists) == (20, 2)  # the snapshots' listing and the log's
    store.gets = store.lists = 0
    assert follower.fetch_events() == [] and (store.gets, store.lists) == (1, 0)
    for i in range(21, 24):
        append(writer, registered(record(f"bot{i}", f"{i:064x}", i), pinned=False))
    assert [seq for seq, _ in follower.fetch_events()] == [21, 22, 23]
    assert (store.gets, store.lists) == (1 + 4, 0)


@pytest.mark.parametrize("read", ["fetch_events", "fetch_tail"])
def test_the_log_is_read_up_to_its_first_gap(tmp_path: Path, read: str) -> None:
    """An entry whose write has not landed yet hides the ones after it until it does."""
    store = LocalStore(tmp_path)
    events = {seq: ev.PinSet(name="x", pinned=bool(seq % 2)) for seq in range(1, 7)}
    for seq in (1, 2, 3, 5, 6):
        store.put_bytes(catalog_module.log_key(seq), json.dumps(ev.to_json(events[seq])).encode())
    cat = Catalog(store)
    got = getattr(cat, read)()
    assert [seq for seq, _ in got] == [1, 2, 3]
    for seq, event in got:
        cat.apply(seq, event)
    store.put_bytes(catalog_module.log_key(4), json.dumps(ev.to_json(events[4])).encode())
    assert [(seq, e.id) for seq, e in getattr(cat, read)()] == [
        (seq, events[seq].id) for seq in (4, 5, 6)
    ]


def test_two_writers_race_for_one_sequence_number(bucket: str, s3_endpoint: str) -> None:
    settings = RegistrySettings(s3_endpoint_url=s3_endpoint)
    a, b = (Catalog(S3Store(bucket, "shared", settings)) for _ in range(2))
    event_a = registered(record("x", "a" * 64, a.next_engine_id()), pinned=False)
    append(a, event_a)
    # b has not seen a's event: its write must lose
    assert not b.write_event(1, registered(record("y", "b" * 64, 1), pinned=False))
    for seq, event in b.fetch_events():
        b.apply(seq, event)
    append(b, registered(record("y", "b" * 64, b.next_engine_id()), pinned=False))
    for seq, event in a.fetch_events():
        a.apply(seq, event)
    assert a.names() == b.names() == ["x", "y"]
    assert a.resolve(AdapterRef("y")).engine_id == 2


@pytest.mark.parametrize(
    "bad",
    ["", "../x", "a/../b", "a/b/c", "/abs", "a\x00b", "a\nb", "x" * 129, "-lead", "a//b", "a/"],
)
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(AdapterInvalid) as info:
        check_name(bad)
    assert info.value.reason == "name" and info.value.param == "name"


def test_refs() -> None:
    assert parse_ref("acme/bot@0123abcd") == AdapterRef("acme/bot", "0123abcd")
    with pytest.raises(AdapterInvalid, match="hex"):
        parse_ref("acme/bot@latest")


def test_a_write_retried_after_a_lost_response_counts_as_written(
    bucket: str, s3_endpoint: str
) -> None:
    # What botocore's retry of a PutObject whose response was lost sees: 412, its own object.
    cat = Catalog(S3Store(bucket, "retried", RegistrySettings(s3_endpoint_url=s3_endpoint)))
    first = registered(record("x", "a" * 64, 1), pinned=False)
    assert cat.write_event(1, first)
    assert cat.write_event(1, first)  # the same event again: already there, written
    assert not cat.write_event(1, ev.Moved(name="x", version="a" * 64))


class _ConflictingStore(LocalStore):
    """S3 under a concurrent conditional write of a log entry: the put is refused (409) while
    the entry is not readable yet, and `lands` says what appears `after` reads (None: never)."""

    def __init__(self, root: Path, lands: ev.Event | None, after: int) -> None:
        super().__init__(root)
        self.lands, self.after, self.reads = lands, after, 0

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        raise ObjectExists(key)

    def get_bytes(self, key: str) -> bytes:
        self.reads += 1
        if self.lands is not None and self.reads > self.after:
            super().put_bytes(key, json.dumps(ev.to_json(self.lands)).encode())
            return super().get_bytes(key)
        raise ObjectMissing(key)


def test_a_write_refused_while_another_is_in_progress_waits_for_it_to_settle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(catalog_module, "WRITE_SETTLE_DELAYS_S", (0.0, 0.0, 0.0))
    mine = registered(record("x", "a" * 64, 1), pinned=False)
    theirs = ev.Moved(name="x", version="a" * 64)
    # Our own earlier attempt lands on the second read: written (the id is ours).
    assert Catalog(_ConflictingStore(tmp_path / "ours", mine, after=1)).write_event(1, mine)
    # Another writer's lands: not written, the caller re-plans.
    assert not Catalog(_ConflictingStore(tmp_path / "theirs", theirs, after=2)).write_event(1, mine)
    # Nothing lands in time: the write may still be ours, so no re-plan; the caller's 503.
    never = _ConflictingStore(tmp_path / "never", None, after=0)
    with pytest.raises(StoreUnavailable, match="has not landed"):
        Catalog(never).write_event(1, mine)
    assert never.reads == 3


def test_a_move_to_a_version_the_name_no_longer_has_is_ignored(tmp_path: Path) -> None:
    """What a log written before rollbacks were checked on fresh state may hold."""
    cat = Catalog(LocalStore(tmp_path))
    append(cat, registered(record("x", "a" * 64, 1), pinned=False))
    append(cat, ev.Moved(name="x", version="f" * 64, rollback=True))
    for c in (cat, replay(cat.store)):
        assert c.resolve(AdapterRef("x")).version == "a" * 64


def test_a_snapshot_pointing_a_name_at_a_version_it_lacks_is_repaired_on_load(
    tmp_path: Path,
) -> None:
    """What a replica before the move check may have written after a stale rollback."""
    cat = Catalog(LocalStore(tmp_path))
    append(cat, registered(record("x", "a" * 64, 1), pinned=False))
    append(cat, registered(record("x", "b" * 64, 2), pinned=True))
    append(cat, registered(record("y", "c" * 64, 3), pinned=False))
    snap = cat.snapshot()
    for entry in snap["names"]:
        entry["version"] = "f" * 64  # x keeps a@ in its history, y has no other version
    loaded = Catalog(LocalStore(tmp_path / "other"))
    loaded.load_snapshot(snap)
    assert loaded.resolve(AdapterRef("x")).version == "a" * 64 and loaded.names() == ["x"]


def test_quarantine_replays_survives_snapshots_and_goes_with_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(catalog_module, "SNAPSHOT_EVERY", 1)
    store = LocalStore(tmp_path)
    cat = Catalog(store)
    v1, v2 = "a" * 64, "b" * 64
    append(cat, registered(record("bot", v1, 1), pinned=False))
    append(cat, registered(record("bot", v2, 2), pinned=False))
    append(cat, ev.Quarantined(name="bot", version=v1, reason="nan"))
    append(cat, ev.Quarantined(name="bot", version="c" * 64, reason="unknown version"))
    unknown = {"op": "renamed_in_a_later_release", "name": "bot", "at": 0.0, "id": "x"}
    store.put_bytes(catalog_module.log_key(cat.last_seq + 1), json.dumps(unknown).encode())
    for seq, event in cat.fetch_events():  # unknown ops: ignored
        cat.apply(seq, event)
    cat.write_snapshot(cat.snapshot())
    for c in (cat, replay(store)):
        assert c.health("bot", v1) is VersionHealth.QUARANTINED
        assert c.health("bot", v2) is VersionHealth.HEALTHY
        quarantine = c.quarantine_of("bot", v1)
        assert quarantine is not None and quarantine.reason == "nan"
        assert c.quarantined_engine_ids() == {1}
    append(cat, ev.Unquarantined(name="bot", version=v1))
    assert replay(store).health("bot", v1) is VersionHealth.HEALTHY
    append(cat, ev.Quarantined(name="bot", version=v2, reason="inf"))
    append(cat, ev.Deleted(name="bot"))
    append(cat, registered(record("bot", v2, 3), pinned=False))  # the same bytes
    assert replay(store).health("bot", v2) is VersionHealth.HEALTHY  # a fresh history


def test_records_replay_survive_snapshots_and_change_by_new_mappings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another part of the server's records (the tenants') ride the log: set and removed by key,
    carried by every snapshot, and each change gives a new mapping (readers compare identity)."""
    monkeypatch.setattr(catalog_module, "SNAPSHOT_EVERY", 2)
    store = LocalStore(tmp_path)
    cat = Catalog(store)
    assert cat.records("tenants") is None
    append(cat, ev.RecordsChanged(name="tenants", changes={"a": {"v": 1}, "b": {"v": 2}}))
    first = cat.records("tenants")
    append(cat, registered(record("bot", "a" * 64, 1), pinned=False))
    assert cat.records("tenants") is first  # an adapter's event leaves them as they were
    cat.write_snapshot(cat.snapshot())
    append(cat, ev.RecordsChanged(name="tenants", changes={"a": None, "c": {"v": 3}}))
    assert cat.records("tenants") is not first and first == {"a": {"v": 1}, "b": {"v": 2}}
    for c in (cat, replay(store)):
        assert c.records("tenants") == {"b": {"v": 2}, "c": {"v": 3}}
        assert c.records("other") is None and c.names() == ["bot"]
