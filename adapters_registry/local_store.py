"""A local directory as an object store: the embedded default, and tests that need no S3.

Writes go to a temporary file renamed into place, so a reader never sees half an object;
exclusive creation uses `os.link`, which fails atomically if the key exists.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

from loraplex.adapters_registry.store import ObjectExists, ObjectMissing, Progress

_CHUNK = 1 << 20


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
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
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
                if f.startswith(".tmp-"):
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
