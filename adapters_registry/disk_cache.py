"""The local disk tier: verified adapter folders under a byte bound, least recently used out first.

Layout under `root`: `versions/<version>/` holds one version's files plus `files.json` (their
names, sizes, hashes); `tmp/` holds downloads in progress. A version is built in `tmp/`, every file
is checked against its sha256, fsynced, and only then is the folder renamed into `versions/`: a
crash, a `kill -9` or a store fault never leaves a partial or corrupt version where it could be
served. At start `tmp/` is emptied and the index is rebuilt from `versions/` (sizes re-checked).

The index lives in this process, so one process owns a cache folder: it holds an exclusive lock
on `root/.lock` until `close`. A second process on the same folder would serve hits for folders the
first evicted, clash on installs, and empty the first's downloads in progress at its start; it
waits LOCK_WAIT_S for the owner to exit (a restart right after a crash), then refuses to start.
A version damaged behind the cache's back (files gone or short) is dropped at its next lookup.

Blocking; called from worker threads. A lock guards the index. Versions in use (being loaded
into the engine) are not evicted.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.records import FileEntry

MANIFEST = "files.json"
LOCK_WAIT_S = 30.0
_CHUNK = 1 << 20


class CacheError(Exception):
    """A download did not match its hash, or the version cannot fit in the cache."""


class HashMismatch(CacheError):
    """A downloaded file is not the bytes its hash names: worth fetching once more."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def digest_folder(folder: Path, names: tuple[str, ...]) -> tuple[str, tuple[FileEntry, ...]]:
    """(version, files): version = sha256 over the files' bytes in `names` order, and each
    file's own sha256 and size. One read per file."""
    version = hashlib.sha256()
    entries = []
    for name in names:
        own = hashlib.sha256()
        with (folder / name).open("rb") as f:
            while chunk := f.read(_CHUNK):
                version.update(chunk)
                own.update(chunk)
        entries.append(FileEntry(name, own.hexdigest(), (folder / name).stat().st_size))
    return version.hexdigest(), tuple(entries)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock_folder(root: Path, wait_s: float) -> int:
    """An open descriptor holding an exclusive flock on `root/.lock` (see the module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise CacheError(
                    f"the disk cache {root} is in use by another process (waited {wait_s:.0f} "
                    "s): give each replica on a host its own cache_dir"
                ) from None
            time.sleep(0.2)


class DiskCache:
    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        metrics: RegistryMetrics,
        lock_wait_s: float = LOCK_WAIT_S,
    ) -> None:
        self._lock_fd: int | None = _lock_folder(root, lock_wait_s)
        try:
            self._open(root, capacity_bytes, metrics)
        except BaseException:
            self.close()
            raise

    def _open(self, root: Path, capacity_bytes: int, metrics: RegistryMetrics) -> None:
        self.capacity_bytes = capacity_bytes
        self._versions = root / "versions"
        self._tmp = root / "tmp"
        self._metrics = metrics
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # version -> bytes, LRU first
        self._in_use: dict[str, int] = {}
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._versions.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    def close(self) -> None:
        """Let another process own the folder (idempotent)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _rebuild(self) -> None:
        found = []
        for folder in self._versions.iterdir():
            size = self._check_folder(folder)
            if size is None:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                found.append((folder.stat().st_mtime, folder.name, size))
        for _, version, size in sorted(found):
            self._index[version] = size
        self._publish()

    @staticmethod
    def _check_folder(folder: Path) -> int | None:
        try:
            files = [FileEntry(**f) for f in json.loads((folder / MANIFEST).read_text())]
            if all((folder / f.name).stat().st_size == f.size for f in files):
                return sum(f.size for f in files)
        except (OSError, ValueError, TypeError):
            pass
        return None

    def _publish(self) -> None:
        self._metrics.resident_bytes.labels("disk").set(sum(self._index.values()))
        self._metrics.resident.labels("disk").set(len(self._index))

    @property
    def used_bytes(self) -> int:
        return sum(self._index.values())

    def path(self, version: str) -> Path:
        return self._versions / version

    def lookup(self, version: str) -> Path | None:
        """The folder of `version` if cached (and marks it recently used), else None."""
        with self._lock:
            if version not in self._index:
                return None
            if self._check_folder(self.path(version)) is None:  # damaged behind our back
                self._discard(version)
                return None
            self._index.move_to_end(version)
        return self.path(version)

    def contains(self, version: str) -> bool:
        """Whether `version` is cached (does not count as a use)."""
        return version in self._index

    def cached(self) -> set[str]:
        with self._lock:
            return set(self._index)

    def new_temp_dir(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self._tmp))

    @contextmanager
    def in_use(self, version: str) -> Iterator[None]:
        """Keep `version` from eviction while the engine reads it."""
        with self._lock:
            self._in_use[version] = self._in_use.get(version, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._in_use[version] -= 1
                if not self._in_use[version]:
                    del self._in_use[version]

    def fetch(
        self, version: str, files: tuple[FileEntry, ...], get: Callable[[FileEntry, Path], None]
    ) -> Path:
        """Download `files` with `get(entry, dest)` into a temp folder, verify, install."""
        tmp = self.new_temp_dir()
        try:
            for entry in files:
                get(entry, tmp / entry.name)
                actual = sha256_file(tmp / entry.name)
                if actual != entry.sha256:
                    raise HashMismatch(
                        f"{entry.name} does not match its hash (expected sha256 {entry.sha256[:12]}"
                        f"..., got {actual[:12]}...)"
                    )
            return self.install(version, tmp, files)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def install(self, version: str, folder: Path, files: tuple[FileEntry, ...]) -> Path:
        """Move a verified `folder` (inside this cache's tmp/) into place as `version`."""
        size = sum(f.size for f in files)
        (folder / MANIFEST).write_text(json.dumps([f.__dict__ for f in files]))
        for entry in (*files, FileEntry(MANIFEST, "", 0)):
            with (folder / entry.name).open("rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(folder)
        with self._lock:
            if version in self._index:
                self._index.move_to_end(version)
                return self.path(version)
            self._make_room(size)
            self._delete_folder(version)  # a leftover not in the index (damaged, discarded)
            os.rename(folder, self.path(version))
            _fsync_dir(self._versions)
            self._index[version] = size
            self._publish()
        self._metrics.loads.labels("disk").inc()
        return self.path(version)

    def _make_room(self, size: int) -> None:
        if size > self.capacity_bytes:
            raise CacheError(
                f"adapter of {size} bytes exceeds the disk cache (registry.disk_cache_gib = "
                f"{self.capacity_bytes} bytes)"
            )
        for victim in list(self._index):
            if self.used_bytes + size <= self.capacity_bytes:
                return
            if victim not in self._in_use:
                self._remove(victim)
        if self.used_bytes + size > self.capacity_bytes:
            raise CacheError("disk cache is full of adapters in use; try again shortly")

    def _remove(self, version: str) -> None:
        self._discard(version)
        self._metrics.evictions.labels("disk").inc()

    def _discard(self, version: str) -> None:
        """Drop a version whose folder is damaged or gone (not an eviction)."""
        self._delete_folder(version)
        del self._index[version]
        self._publish()

    def _delete_folder(self, version: str) -> None:
        # Rename first so a reader never sees a half-deleted folder under versions/.
        doomed = self._tmp / f"evict-{version}"
        try:
            os.rename(self.path(version), doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def retain(self, versions: set[str]) -> list[str]:
        """Remove every cached version not in `versions` and not in use; those removed."""
        with self._lock:
            doomed = [v for v in self._index if v not in versions and v not in self._in_use]
            for version in doomed:
                self._discard(version)
        return doomed

    def evict(self, version: str) -> bool:
        """Remove `version` unless absent or in use; True if it was removed."""
        with self._lock:
            if version not in self._index or version in self._in_use:
                return False
            self._remove(version)
            return True
