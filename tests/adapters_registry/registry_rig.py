"""A bucket with adapter sources and a registry store on moto, and registries built over it.

Two registries on one bucket play two replicas; one rebuilt on the same cache folder, a restart.
The engine is the small fake (these are tests of the registry's logic, not of vLLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
from prometheus_client import CollectorRegistry
from registry_builders import adapter_config, dense_tensors, write_adapter
from registry_fake_engine import FakeEngine

from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.engine import LoraTargets
from loraplex.adapters_registry.lifecycle import build_registry
from loraplex.adapters_registry.settings import RegistrySettings


class Rig:
    """A bucket with adapter sources under `src/` and a registry store under `registry/`."""

    def __init__(self, tmp_path: Path, bucket: str, endpoint: str, dense_model: Path) -> None:
        self.tmp, self.bucket, self.endpoint, self.model = tmp_path, bucket, endpoint, dense_model
        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def source(
        self, name: str, seed: int = 0, modules: tuple[str, ...] | None = None, **config: Any
    ) -> str:
        tensors = dense_tensors(seed=seed, **({"modules": modules} if modules else {}))
        folder = write_adapter(self.tmp / "src" / name, adapter_config(**config), tensors)
        for f in folder.iterdir():
            self.s3.upload_file(str(f), self.bucket, f"src/{name}/{f.name}")
        return f"s3://{self.bucket}/src/{name}/"

    async def registry(
        self,
        cache: str,
        engine: FakeEngine | None = None,
        endpoint: str | None = None,
        lora_targets: LoraTargets | None = None,
    ) -> ManagedRegistry:
        settings = RegistrySettings(
            store=f"s3://{self.bucket}/registry", s3_endpoint_url=endpoint or self.endpoint,
            s3_max_attempts=3, poll_interval_s=0.2,
        )  # fmt: skip
        return await build_registry(
            settings, engine or FakeEngine(), model_dir=self.model, base_model_name="tiny",
            max_lora_rank=16, max_loras=2, max_cpu_loras=3, cache_root=self.tmp / cache,
            lora_targets=lora_targets, metrics_registry=CollectorRegistry(),
        )  # fmt: skip


def metric(reg: ManagedRegistry, name: str, **labels: str) -> float:
    value = reg.metrics.collector_registry.get_sample_value(name, labels)
    return float(value or 0.0)
