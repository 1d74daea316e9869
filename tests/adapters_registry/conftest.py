"""Fixtures for the registry's tests: a real S3-protocol server (moto) on loopback, tiny models."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from registry_builders import write_base_model
from registry_rig import Rig

from tests.support.moto_s3 import moto_s3
from tests.support.s3_fault_proxy import FaultProxy


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1; boto3 speaks real HTTP + SigV4 to it."""
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    name = f"reg-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def fault_proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port))
    yield proxy
    proxy.close()


@pytest.fixture(scope="session")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_model(tmp_path_factory.mktemp("dense-model"))


@pytest.fixture(scope="session")
def fused_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_model(tmp_path_factory.mktemp("fused-moe"), moe="fused")


@pytest.fixture(scope="session")
def per_expert_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_model(tmp_path_factory.mktemp("per-expert-moe"), moe="per_expert")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def rig(tmp_path: Path, bucket: str, s3_endpoint: str, dense_model: Path) -> Rig:
    return Rig(tmp_path, bucket, s3_endpoint, dense_model)
