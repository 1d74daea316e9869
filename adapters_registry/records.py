"""One version of an adapter as the catalog records it: immutable, named by the sha256 of its
files, each file stored in the registry's store under its own hash (`catalog.blob_key`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FileEntry:
    """One file of a version: its name inside the adapter folder and its content hash."""

    name: str
    sha256: str
    size: int


@dataclass(frozen=True)
class VersionRecord:
    """One immutable version of an adapter. `version` is the sha256 over its files."""

    name: str
    version: str
    engine_id: int
    rank: int
    files: tuple[FileEntry, ...]
    base_model: str
    source: str
    created_at: float

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> VersionRecord:
        files = tuple(FileEntry(**f) for f in d["files"])
        return cls(**{**d, "files": files})
