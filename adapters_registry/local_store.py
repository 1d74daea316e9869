"""A local directory as an object store: the embedded default, and tests that need no S3.

Writes go to a temporary file (`.tmp-*`) renamed into place, so a reader never sees half an
object; exclusive creation uses `os.link`, which fails atomically if the key exists. Replicas may
share a directory (on one host, or NFS): each holds a shared flock on its `.users` file for its
life (`claim_users_lock`), so start-up can tell whether any other process uses the store.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from loraplex.adapters_registry.store import ObjectExists, ObjectMissing, Progress

_CHUNK = 1 << 20
_TEMP_PREFIX = ".tmp-"
_USERS_FILE = ".users"


class LocalStore:
    """`read_links`: a key may be a link to a regular file outside the root (read-only sources:
    a Hugging Face hub snapshot links each file to ../../blobs/), on the root's filesystem: a
    link to /proc/self/pagemap lists as 0 bytes and reads without end, one to /dev/zero too.
    Links are resolved once (a loop is refused) and the file reached is opened without
    following further links. Keys themselves never climb out (`..`); without `read_links`
    neither may the files they resolve to. Refusals are ValueErrors."""

    def __init__(self, root: Path, *, read_links: bool = False) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.uri = str(self.root)
        self._read_links = read_links
        self._device = self.root.stat().st_dev
        self._users_fd: int | None = None

    def claim_users_lock(self) -> bool:
        """Become one of the store's users for the life of this object. True: no other process
        uses it, and none may until `share_users_lock` (they wait in this call); False: others
        do (this call waited for one's exclusive hold to end). Blocking."""
        if self._users_fd is None:
            self._users_fd = os.open(self.root / _USERS_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)
            return False

    def share_users_lock(self) -> None:
        """Let other processes use the store beside this one (after `claim_users_lock`)."""
        if self._users_fd is not None:
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)

    def _path(self, key: str) -> Path:
        path = Path(os.path.normpath(self.root / key))
        try:
            resolved = path.resolve()
        except (RuntimeError, OSError) as e:  # RuntimeError: Python 3.11's "Symlink loop"
            raise ValueError(f"{key}: its links loop or cannot be followed") from e
        if not path.is_relative_to(self.root) or not (
            self._read_links or resolved.is_relative_to(self.root)
        ):
            raise ValueError(f"key {key!r} escapes the store root")
        if self._read_links and resolved.exists():
            self._check_readable(key, resolved.stat())
        return resolved

    def _check_readable(self, key: str, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{key} is not a regular file")
        if self._read_links and st.st_dev != self._device:
            raise ValueError(f"{key} is on another filesystem than the source (e.g. /proc)")

    def _open(self, key: str) -> BinaryIO:
        """`key` opened for reading at the path its links resolved to, following none again."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError as e:
            raise ObjectMissing(key) from e
        except OSError as e:  # ELOOP: a link put there since it was resolved
            raise ValueError(f"{key}: its links changed while being read") from e
        src = os.fdopen(fd, "rb")
        try:
            self._check_readable(key, os.fstat(fd))
        except BaseException:
            src.close()
            raise
        return src

    def _temp_beside(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX)
        os.close(fd)
        return Path(name)

    def get_bytes(self, key: str) -> bytes:
        with self._open(key) as src:
            return src.read()

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        path = self._path(key)
        tmp = self._temp_beside(path)
        try:
            tmp.write_bytes(data)
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError as e:
                    raise ObjectExists(key) from e
            else:
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError as e:
            raise ObjectMissing(key) from e

    def list_keys(self, prefix: str, start_after: str = "", *, nested: bool = True) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, dirs, files in os.walk(base):
            if not nested:
                dirs.clear()  # this folder's files only
            for f in files:
                if f.startswith(_TEMP_PREFIX) or (dirpath == str(self.root) and f == _USERS_FILE):
                    continue
                key = Path(dirpath, f).relative_to(self.root).as_posix()
                if key > start_after:
                    keys.append(key)
        return sorted(keys)

    def download(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        with self._open(key) as src, dest.open("wb") as out:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                if progress:
                    progress(len(chunk))

    def modified(self, key: str) -> float:
        try:
            return self._path(key).stat().st_mtime
        except FileNotFoundError as e:
            raise ObjectMissing(key) from e

    def touch(self, key: str) -> None:
        try:
            os.utime(self._path(key))
        except FileNotFoundError as e:
            raise ObjectMissing(key) from e

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def remove_partial_writes(self, older_than_s: float) -> list[str]:
        removed = []
        cutoff = time.time() - older_than_s
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                path = Path(dirpath, f)
                if f.startswith(_TEMP_PREFIX) and _mtime(path) < cutoff:
                    path.unlink(missing_ok=True)
                    removed.append(path.relative_to(self.root).as_posix())
        return removed

    def upload(self, src: Path, key: str, progress: Progress | None = None) -> None:
        path = self._path(key)
        tmp = self._temp_beside(path)
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        if progress:
            progress(path.stat().st_size)


def _mtime(path: Path) -> float:
    """Its modification time; +inf if it is gone (its writer renamed it into place)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")
