"""Object stores: where adapter weights and the catalog live (S3 or a local directory).

Every method blocks (network or disk I/O) and is called from worker threads, never on the event
loop. Keys are '/'-separated and relative to the store's root (bucket prefix or directory).
Failures are one of the errors below; `StoreUnavailable` means retries were exhausted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from loraplex.adapters_registry.settings import RegistrySettings

Progress = Callable[[int], None]
"""Called with the number of bytes moved since the previous call (boto3's callback contract)."""


class StoreError(Exception):
    """Base of object-store failures."""


class ObjectMissing(StoreError):
    """The key does not exist."""


class ObjectExists(StoreError):
    """A conditional write found the key already there (another writer got there first)."""


class StoreUnavailable(StoreError):
    """The store failed after retries (5xx, throttling, timeouts, resets)."""


class ContentMismatch(StoreError):
    """The bytes received do not match the object's checksum; fetching again may succeed."""


class ObjectStore(Protocol):
    """A flat key -> bytes store with exclusive creation. Safe to use from many threads."""

    uri: str

    def get_bytes(self, key: str) -> bytes:
        """Read a small object whole. Raises ObjectMissing."""
        ...

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write a small object. With `if_absent`, raise ObjectExists instead of overwriting."""
        ...

    def size(self, key: str) -> int:
        """Size of an object in bytes. Raises ObjectMissing."""
        ...

    def list_keys(self, prefix: str, start_after: str = "", *, nested: bool = True) -> list[str]:
        """Keys under `prefix` sorted ascending, only those greater than `start_after`; with
        `nested` False only those with no further `/` after the prefix (one folder's files)."""
        ...

    def download(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        """Write the object to `dest` (parallel ranged reads where supported). Raises
        ObjectMissing; on any failure `dest` may hold partial bytes and must be discarded."""
        ...

    def upload(self, src: Path, key: str, progress: Progress | None = None) -> None:
        """Store the file `src` under `key` (multipart where supported), replacing it."""
        ...

    def modified(self, key: str) -> float:
        """When the object was last written or touched (epoch seconds). Raises ObjectMissing."""
        ...

    def touch(self, key: str) -> None:
        """Make the object's modification time now, its bytes unchanged. Raises ObjectMissing."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object; a missing one is no error."""
        ...

    def remove_partial_writes(self, older_than_s: float) -> list[str]:
        """Remove writes that never completed (a process killed mid-write: a local store's
        `.tmp-*` files, S3's multipart uploads never completed) begun more than `older_than_s`
        ago; what was removed, by key."""
        ...


# botocore's own check (handlers.VALID_BUCKET), which otherwise fails the first request with a
# ParamValidationError that reads as the store being down.
_BUCKET_RE = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b/` -> ("bucket", "a/b"); raises ValueError on anything else."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if len(bucket) < 3:
        raise ValueError(f"S3 bucket name in {uri!r} must have at least 3 characters")
    if not _BUCKET_RE.fullmatch(bucket):
        raise ValueError(
            f"S3 bucket name {bucket!r} may hold only letters, digits, '.', '-' and '_'"
        )
    return bucket, prefix.strip("/")


def open_store(uri: str, settings: RegistrySettings) -> ObjectStore:
    """A store for `uri`: `s3://bucket/prefix` or a local directory path."""
    if uri.startswith("s3://"):
        from loraplex.adapters_registry.s3_store import S3Store

        bucket, prefix = split_s3_uri(uri)
        return S3Store(bucket, prefix, settings)
    from loraplex.adapters_registry.local_store import LocalStore

    return LocalStore(Path(uri))
