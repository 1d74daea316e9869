"""Fetching an adapter from where a user points at it, and publishing its files to the store.

A source is `s3://bucket/prefix/`, `hf://org/name[@revision][/folder]` (a model repository on the
Hugging Face Hub, through its cache: `hub`) or a local directory holding PEFT's
`adapter_config.json` and `adapter_model.safetensors`. Registration copies those two files into
the registry's own store,
content-addressed (`blobs/sha256/<hash>`), so a version stays immutable even if the source
prefix is overwritten later. Copies stop at the size caps as they read, whatever size the
source reported (a file can list as 0 bytes and read without end). Everything here blocks and
runs in worker threads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loraplex.adapters_registry.base import AdapterInvalid, AdapterUnavailable
from loraplex.adapters_registry.catalog import blob_key
from loraplex.adapters_registry.hub import (
    HUB_SCHEME,
    HubError,
    HubFolder,
    HubUnavailable,
    hub_snapshot,
)
from loraplex.adapters_registry.local_store import LocalStore
from loraplex.adapters_registry.peft_config import CONFIG_FILE, MAX_CONFIG_BYTES
from loraplex.adapters_registry.records import FileEntry
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.store import (
    ObjectMissing,
    ObjectStore,
    StoreError,
    open_store,
)
from loraplex.adapters_registry.validation import (
    ADAPTER_FILES,
    WEIGHTS_FILE,
    check_listing,
    too_large,
)


class _Budget:
    """A transfer's progress callback that stops the copy once it passes `limit` bytes."""

    def __init__(self, limit: int, refuse: Callable[[int], Exception]) -> None:
        self.limit, self.moved, self._refuse = limit, 0, refuse

    def __call__(self, moved: int) -> None:
        self.moved += moved
        if self.moved > self.limit:
            raise self._refuse(self.moved)


def open_source(source: str, settings: RegistrySettings) -> ObjectStore:
    if source.startswith("s3://"):
        try:
            return open_store(source, settings)
        except ValueError as e:
            raise AdapterInvalid(str(e), param="source", reason="source") from e
    if source.startswith(HUB_SCHEME):
        return _open_hub(source, settings)
    try:
        is_dir = Path(source).is_dir()
    except OSError as e:  # e.g. a name too long for the file system
        raise AdapterInvalid(f"source: {e}", param="source", reason="source") from e
    if not is_dir:
        raise AdapterInvalid(
            f"source {source!r} is neither s3://bucket/prefix, hf://org/name nor an existing "
            "local directory",
            param="source",
            reason="source",
        )
    return LocalStore(Path(source), read_links=True)


def _open_hub(source: str, settings: RegistrySettings) -> LocalStore:
    """The adapter folder of an `hf://` source in the Hugging Face cache, fetched there first if
    the Hub answers (its two files only, refused by their listed sizes before they move); its
    files link to the cache's blobs, which the store reads as it reads any linked source."""
    try:
        where = HubFolder.parse(source)
    except ValueError as e:
        raise AdapterInvalid(f"source: {e}", param="source", reason="source") from e
    max_bytes = settings.max_adapter_mib * 1024 * 1024
    try:
        snapshot = hub_snapshot(
            where.ref, ADAPTER_FILES, folder=where.folder,
            check_sizes=lambda sizes: check_listing(sizes, max_bytes),
        )  # fmt: skip
    except HubUnavailable as e:
        raise AdapterUnavailable(f"source {source}: {e.detail}", param="source") from e
    except HubError as e:
        raise AdapterInvalid(f"source {source}: {e.detail}", param="source", reason="source") from e
    folder = snapshot / where.folder
    if not folder.is_dir() or not folder.resolve().is_relative_to(snapshot.resolve()):
        raise AdapterInvalid(
            f"source {source}: {where.ref.repo_id} at commit {snapshot.name} has no folder "
            f"{where.folder or '/'!r} ({snapshot})",
            param="source",
            reason="source",
        )
    return LocalStore(folder, read_links=True)


def fetch_source(source: str, dest: Path, settings: RegistrySettings) -> None:
    """Download the adapter's files from `source` into `dest`, refusing pickle-only, missing or
    oversized adapters before any weight byte moves. Raises AdapterInvalid/AdapterUnavailable."""
    store = open_source(source, settings)
    try:
        try:
            # One folder's files: a source pointed at a bucket's root lists that, not the bucket.
            top_level = store.list_keys("", nested=False)
        except ObjectMissing as e:
            raise AdapterInvalid(
                f"source {source} does not exist (no such bucket)", param="source", reason="source"
            ) from e
        sizes = {k: store.size(k) if k in ADAPTER_FILES else 0 for k in top_level}
        max_bytes = settings.max_adapter_mib * 1024 * 1024
        check_listing(sizes, max_bytes)
        config_bytes = _copy(store, CONFIG_FILE, dest, min(MAX_CONFIG_BYTES, max_bytes), 0)
        _copy(store, WEIGHTS_FILE, dest, max_bytes - config_bytes, config_bytes)
        # Again on the bytes that came: the source may have changed since it was listed.
        check_listing({name: (dest / name).stat().st_size for name in ADAPTER_FILES}, max_bytes)
    except ObjectMissing as e:
        raise AdapterInvalid(
            f"{e} vanished from {source} during registration", param="source", reason="source"
        ) from e
    except ValueError as e:  # a local source's file the store refuses to read (LocalStore)
        raise AdapterInvalid(f"source {source}: {e}", param="source", reason="source") from e
    except StoreError as e:
        raise AdapterUnavailable(f"cannot read source {source}: {e}", param="source") from e


def _copy(store: ObjectStore, name: str, dest: Path, limit: int, before: int) -> int:
    """Copy `name` into `dest`, refused as it passes `limit` bytes; the bytes copied. `before`:
    the adapter's bytes copied already, for the message."""
    if name == CONFIG_FILE:
        budget = _Budget(
            limit, lambda n: too_large(CONFIG_FILE, n, limit, "MAX_CONFIG_BYTES", read=True)
        )
    else:
        budget = _Budget(
            limit, lambda n: too_large(WEIGHTS_FILE, before + n, before + limit, read=True)
        )
    store.download(name, dest / name, progress=budget)
    return budget.moved


def publish_blobs(store: ObjectStore, folder: Path, files: tuple[FileEntry, ...]) -> None:
    """Upload each file to its content address unless an object of that size is there already;
    one that is, is touched: a start-up sweep on another replica deletes only blobs no version
    references that have not been modified for a while (`cleanup`), and this one's version is
    not in the catalog yet."""
    for entry in files:
        key = blob_key(entry.sha256)
        try:
            if store.size(key) == entry.size:
                store.touch(key)
                continue
        except ObjectMissing:
            pass
        store.upload(folder / entry.name, key)
