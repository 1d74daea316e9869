"""deploy/compose: the file validates against the Compose specification's JSON schema, and the
services agree with each other and with the server: the settings load with loraplex's own
loader, the published port is the one the server binds, the bucket the store names is the one
created, Prometheus scrapes the server and Grafana gets the dashboard.

Docker cannot run here (no image registry): this checks the file, not a running stack.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from loraplex.adapters_registry.store import split_s3_uri
from tests.deploy.manifests import (
    CRD_DIR,
    DOCKERFILES,
    REPO,
    app_for,
    dockerfile_env,
    load_with,
    route_paths,
    shutdown_budget_s,
)

COMPOSE_DIR = REPO / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE_FILE.read_text()))


def test_compose_file_validates_against_the_compose_spec(compose: dict[str, Any]) -> None:
    # The file names draft-07 as `https://json-schema.org/draft-07/schema`, without the `#`
    # jsonschema looks its metaschemas up by.
    validator = jsonschema.Draft7Validator(json.loads((CRD_DIR / "compose-spec.json").read_text()))
    validator.validate(compose)
    broken = {**compose, "services": {**compose["services"], "redis": {"imag": "redis"}}}
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


def _bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """{container path: host path} of a service's bind mounts (named volumes left out)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (COMPOSE_DIR / source).resolve()
    return mounts


def test_every_bind_mount_and_build_file_exists(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for target, source in _bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target})"
        if "build" in service:
            context = (COMPOSE_DIR / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).is_file(), name


def _server(compose: dict[str, Any], tmp_path: Path) -> tuple[Any, dict[str, str]]:
    service = compose["services"]["loraplex"]
    env = dockerfile_env(DOCKERFILES[service["image"].rsplit(":", 1)[0]])
    env.update({k: str(v) for k, v in service["environment"].items()})
    config = _bind_mounts(service)[env["LORAPLEX_CONFIG_FILE"]]
    return load_with(env, config.read_text(), tmp_path), env


def test_server_settings_load_and_its_port_is_published(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    settings, _ = _server(compose, tmp_path)
    service = compose["services"]["loraplex"]
    assert settings.http.host == "0.0.0.0"
    assert f"{settings.http.port}:{settings.http.port}" in service["ports"]
    # The image's HEALTHCHECK probes /health: a route the server has.
    assert "/health" in route_paths(app_for(settings))
    assert "/health" in DOCKERFILES["loraplex-cpu"].read_text().split("HEALTHCHECK", 1)[1]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
    assert volumes[str(settings.cache_dir)] in compose["volumes"], "cache_dir is not on a volume"


def test_stop_grace_period_covers_the_drain_and_the_engine_stop(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """`docker compose stop` kills the server at stop_grace_period (10 s unless set)."""
    settings, _ = _server(compose, tmp_path)
    grace = compose["services"]["loraplex"]["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > shutdown_budget_s(settings)


def test_store_is_the_minio_bucket_the_stack_creates(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    settings, env = _server(compose, tmp_path)
    services = compose["services"]
    assert settings.registry.store
    bucket, _ = split_s3_uri(settings.registry.store)
    endpoint = urlsplit(settings.registry.s3_endpoint_url or "")
    minio = services[endpoint.hostname]
    assert minio["command"][:2] == ["server", "/data"] and endpoint.port == 9000
    creator = services["minio-bucket"]
    assert creator["command"][-1] == f"minio/{bucket}"
    assert creator["depends_on"]["minio"]["condition"] == "service_healthy"
    assert services["loraplex"]["depends_on"]["minio-bucket"] == {
        "condition": "service_completed_successfully"
    }
    mc_host = urlsplit(creator["environment"]["MC_HOST_minio"])
    user, password = (
        minio["environment"]["MINIO_ROOT_USER"],
        minio["environment"]["MINIO_ROOT_PASSWORD"],
    )
    assert (mc_host.username, mc_host.password, mc_host.hostname) == (
        user, password, endpoint.hostname
    )  # fmt: skip
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (user, password)


def test_prometheus_scrapes_the_server_with_the_repository_rules(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    settings, _ = _server(compose, tmp_path)
    mounts = _bind_mounts(compose["services"]["prometheus"])
    assert mounts["/etc/prometheus"] == REPO / "deploy" / "prometheus"
    config = yaml.safe_load((mounts["/etc/prometheus"] / "prometheus.yml").read_text())
    targets = [
        t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    ]
    assert f"loraplex:{settings.http.port}" in targets
    for rule_file in config["rule_files"]:
        assert (mounts["/etc/prometheus"] / rule_file).is_file()


def test_grafana_gets_the_dashboard_and_the_prometheus_datasource(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = _bind_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    providers = yaml.safe_load((provisioning / "dashboards" / "loraplex.yaml").read_text())
    folder = providers["providers"][0]["options"]["path"]
    assert mounts[f"{folder}/loraplex.json"] == REPO / "deploy" / "grafana" / "loraplex.json"
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == (
        f"{folder}/loraplex.json"
    )
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    url = urlsplit(source["url"])
    assert url.hostname in compose["services"] and url.port == 9090
