"""S3 (or any S3-compatible endpoint) as an object store, through boto3.

Credentials come from boto3's standard chain. botocore retries 5xx, throttling and connection
errors with backoff (`registry.s3_retry_mode`, `s3_max_attempts`); large objects move through
boto3's transfer manager: parallel ranged GETs and multipart uploads of `transfer_chunk_mib` parts,
and a body reset mid-stream is re-requested (`num_download_attempts`). Exclusive creation uses
`IfNoneMatch="*"` (S3 answers 412 PreconditionFailed, or 409 under a concurrent conditional write).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError
from s3transfer.exceptions import RetriesExceededError, S3UploadFailedError

from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.store import (
    ContentMismatch,
    ObjectExists,
    ObjectMissing,
    Progress,
    StoreError,
    StoreUnavailable,
)

_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
_EXISTS_CODES = {"412", "PreconditionFailed", "ConditionalRequestConflict"}


def make_s3_client(settings: RegistrySettings) -> Any:
    """A boto3 S3 client configured from the registry settings (also used by the CLI's push)."""
    config = Config(
        region_name=settings.s3_region,
        retries={"mode": settings.s3_retry_mode, "max_attempts": settings.s3_max_attempts},
        connect_timeout=settings.s3_connect_timeout_s,
        read_timeout=settings.s3_read_timeout_s,
        # One pooled connection per concurrent part, or the transfer threads queue on the pool.
        max_pool_connections=max(10, settings.transfer_max_concurrency * 2),
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=settings.s3_endpoint_url, config=config
    )


def make_transfer_config(settings: RegistrySettings) -> TransferConfig:
    chunk = settings.transfer_chunk_mib * 1024 * 1024
    return TransferConfig(
        multipart_threshold=chunk,
        multipart_chunksize=chunk,
        max_concurrency=settings.transfer_max_concurrency,
        num_download_attempts=settings.s3_max_attempts,
        use_threads=True,
    )


def _translate(e: Exception, key: str) -> StoreError:
    if isinstance(e, FlexibleChecksumError):
        return ContentMismatch(f"{key} does not match its hash (S3 checksum): {e}")
    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in _MISSING_CODES or status == "404":
            return ObjectMissing(key)
        if code in _EXISTS_CODES or status in ("412",):
            return ObjectExists(key)
        return StoreUnavailable(f"S3 {code or status} on {key}: {e}")
    return StoreUnavailable(f"S3 failed on {key}: {type(e).__name__}: {e}")


_FAILURES = (ClientError, BotoCoreError, RetriesExceededError, S3UploadFailedError, OSError)


class S3Store:
    def __init__(self, bucket: str, prefix: str, settings: RegistrySettings) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = make_s3_client(settings)
        self._transfer = make_transfer_config(settings)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def get_bytes(self, key: str) -> bytes:
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            return bytes(body.read())
        except _FAILURES as e:
            raise _translate(e, key) from e

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
        except _FAILURES as e:
            raise _translate(e, key) from e

    def size(self, key: str) -> int:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return int(head["ContentLength"])
        except _FAILURES as e:
            raise _translate(e, key) from e

    def list_keys(self, prefix: str, start_after: str = "", *, nested: bool = True) -> list[str]:
        full_prefix = self._key(prefix)
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
        if start_after:
            args["StartAfter"] = self._key(start_after)
        if not nested:  # S3 folds deeper keys into CommonPrefixes, which are not listed here
            args["Delimiter"] = "/"
            if prefix and not prefix.endswith("/"):  # `prefix` names a folder, as locally
                args["Prefix"] = full_prefix + "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(**args):
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        except _FAILURES as e:
            raise _translate(e, prefix) from e
        return keys

    def download(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        try:
            self._client.download_file(
                self.bucket, self._key(key), str(dest), Config=self._transfer, Callback=progress
            )
        except _FAILURES as e:
            raise _translate(e, key) from e

    def modified(self, key: str) -> float:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return float(head["LastModified"].timestamp())
        except _FAILURES as e:
            raise _translate(e, key) from e

    def touch(self, key: str) -> None:
        # A copy onto itself is S3's only way to renew LastModified; the managed copy takes
        # objects past copy_object's 5 GiB in parts.
        source = {"Bucket": self.bucket, "Key": self._key(key)}
        try:
            self._client.copy(
                source, self.bucket, self._key(key), ExtraArgs={"MetadataDirective": "REPLACE"},
                Config=self._transfer,
            )  # fmt: skip
        except _FAILURES as e:
            raise _translate(e, key) from e

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except _FAILURES as e:
            raise _translate(e, key) from e

    def remove_partial_writes(self, older_than_s: float) -> list[str]:
        cutoff = time.time() - older_than_s
        args = {"Bucket": self.bucket, "Prefix": self._key("")}
        strip = len(self.prefix) + 1 if self.prefix else 0
        removed = []
        try:
            for page in self._client.get_paginator("list_multipart_uploads").paginate(**args):
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() < cutoff:
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        removed.append(upload["Key"][strip:])
        except _FAILURES as e:
            raise _translate(e, "multipart uploads") from e
        return removed

    def upload(self, src: Path, key: str, progress: Progress | None = None) -> None:
        try:
            self._client.upload_file(
                str(src), self.bucket, self._key(key), Config=self._transfer, Callback=progress
            )
        except _FAILURES as e:
            raise _translate(e, key) from e
