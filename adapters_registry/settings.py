"""Configuration of the adapter registry (a section of loraplex's settings; read nowhere else)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, Field, model_validator

SafetensorsDtype = Literal["F16", "BF16", "F32"]


class RegistrySettings(BaseModel):
    model_config = {"extra": "forbid"}  # a misspelt key is an error, not a default
    local_dir: Path | None = Field(
        default=None,
        description=(
            "Folder of adapters, one subfolder per adapter holding adapter_config.json and "
            "adapter_model.safetensors, registered at start; unset with the embedded model "
            "registers its demo adapters."
        ),
    )
    store: str | None = Field(
        default=None,
        description=(
            "Where the catalog and adapter weights live: `s3://bucket/prefix` or a local "
            "directory. Replicas pointing at the same store share one catalog. Unset: a local "
            "directory under the cache dir."
        ),
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, moto, ...); unset uses AWS."
    )
    s3_region: str = Field(default="us-east-1", description="Region for request signing.")
    s3_retry_mode: Literal["standard", "adaptive"] = Field(
        default="standard", description="botocore retry mode (5xx, throttling, connection errors)."
    )
    s3_max_attempts: int = Field(
        default=5, ge=1, le=20, description="Attempts per S3 call, retries included."
    )
    s3_connect_timeout_s: float = Field(
        default=5.0, gt=0, description="Seconds to open a connection to S3."
    )
    s3_read_timeout_s: float = Field(
        default=30.0, gt=0, description="Seconds to wait on one socket read from S3."
    )
    transfer_max_concurrency: int = Field(
        default=8, ge=1, le=64, description="Parallel ranged GETs / multipart parts per transfer."
    )
    transfer_chunk_mib: int = Field(
        default=16, ge=5, le=1024, description="Part size of ranged downloads, multipart uploads."
    )
    poll_interval_s: float = Field(
        default=2.0, gt=0, le=300, description="How often a replica reads the catalog's changes."
    )
    disk_cache_gib: float = Field(
        default=20.0, gt=0, description="Adapter bytes kept on local disk (LRU beyond that), GiB."
    )
    max_adapter_mib: int = Field(
        default=2048, ge=1, description="Largest adapter (config + weights) accepted, MiB."
    )
    max_weight_abs: float = Field(
        default=1000.0,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Largest |weight| an adapter may hold as served (lora_B x lora_alpha/r): PEFT's "
            "inits reach 4.7, trained LoRAs tens at most, fp16 overflows at 65504."
        ),
    )
    allowed_dtypes: list[SafetensorsDtype] = Field(
        default_factory=lambda: list(get_args(SafetensorsDtype)),
        description="safetensors dtypes an adapter's tensors may have.",
    )
    orphan_grace_s: float = Field(
        default=3600.0,
        ge=0,
        description=(
            "Age a blob no version references (or a partial write) must reach before start-up "
            "deletes it from a store other replicas use: theirs may be mid-registration."
        ),
    )
    delete_drain_s: float = Field(
        default=60.0, ge=0, description="Seconds a deletion waits for in-flight requests to end."
    )

    @model_validator(mode="after")
    def _largest_adapter_fits_the_disk_cache(self) -> RegistrySettings:
        # An adapter the limit accepts but the cache cannot hold would register, then fail
        # every request.
        if self.max_adapter_mib * 2**20 > self.disk_cache_gib * 2**30:
            raise ValueError(
                f"registry.max_adapter_mib ({self.max_adapter_mib} MiB) must fit in "
                f"registry.disk_cache_gib ({self.disk_cache_gib} GiB)"
            )
        return self
