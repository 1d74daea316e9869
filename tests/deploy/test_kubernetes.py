"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, every object validates
against Kubernetes' schemas or its CRD's, and what the manifests say about the server (probe
paths, ports, settings, metric names) is checked against the server itself.

kubectl must be installed (.ci/run checks it); these tests fail, rather than skip, without it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from loraplex.adapters_registry.names import check_name, parse_ref
from loraplex.server.metrics_access import PICKER_METRICS_PATH
from loraplex.server.picker_metrics import PICKER_ENGINE_FAMILIES
from tests.deploy.manifests import (
    COMPILE_CACHES,
    CRD_DIR,
    KERNEL_CACHES,
    KUSTOMIZE,
    OVERLAYS,
    REPO,
    CrdValidator,
    Obj,
    app_for,
    crd_schemas,
    dockerfile_user,
    image_dockerfile,
    lies_under,
    load_with,
    loraplex_metric_names,
    metric_names_in,
    of_kind,
    one,
    overlay_settings,
    render,
    route_paths,
    server_container,
    server_deployment,
    shutdown_budget_s,
    vllm_metric_names,
)

# The Kubernetes release the manifests are validated for (kubernetes-validate's bundled schemas).
KUBERNETES_VERSION = "1.32"
ALL = ("base", *OVERLAYS)


@pytest.mark.parametrize("overlay", ALL)
def test_overlay_renders_the_whole_stack(overlay: str) -> None:
    kinds = {o["kind"] for o in render(overlay)}
    assert {
        "Deployment", "Service", "ConfigMap", "Secret", "ServiceMonitor", "PrometheusRule",
        "InferencePool", "HTTPRoute", "InferenceObjective", "InferenceModelRewrite",
        "ServiceAccount", "Role", "RoleBinding",
    } <= kinds  # fmt: skip
    if overlay == "gpu":
        assert {"HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds


def _validate(obj: Obj) -> None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        return
    except kubernetes_validate.SchemaNotFoundError:
        pass
    schema = crd_schemas().get((obj["apiVersion"], obj["kind"]))
    assert schema, f"no schema for {obj['apiVersion']} {obj['kind']}: commit its CRD to {CRD_DIR}"
    error = jsonschema.exceptions.best_match(CrdValidator(schema).iter_errors(obj))
    if error is not None:
        raise error


@pytest.mark.parametrize("overlay", ALL)
def test_every_object_validates_against_its_schema(overlay: str) -> None:
    for obj in render(overlay):
        try:
            _validate(obj)
        except jsonschema.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")


def test_schemas_refuse_a_misspelt_field() -> None:
    """The validation itself: an unknown field fails both core and CRD checks."""
    deployment = json.loads(json.dumps(server_deployment(render("base"))))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(jsonschema.ValidationError):
        _validate(deployment)
    pool = json.loads(json.dumps(one(render("base"), "InferencePool", "loraplex")))
    pool["spec"]["targetPort"] = [{"number": 8000}]
    with pytest.raises(jsonschema.ValidationError):
        _validate(pool)


def _render_monitoring_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "render_monitoring", KUSTOMIZE / "render_monitoring.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_monitoring_objects_are_generated_from_deploy_prometheus() -> None:
    module = _render_monitoring_module()
    assert module.OUTPUT.read_text() == module.render(), (
        "deploy/kubernetes/base/monitoring.generated.yaml is stale: "
        "run python deploy/kubernetes/render_monitoring.py"
    )
    rules = {o["metadata"]["name"]: o["spec"] for o in of_kind(render("base"), "PrometheusRule")}
    for path in sorted((REPO / "deploy" / "prometheus" / "rules").glob("*.yml")):
        assert rules[path.stem] == yaml.safe_load(path.read_text()), path.name


@pytest.mark.parametrize("overlay", ALL)
def test_settings_load_with_loraplex_own_loader(overlay: str, tmp_path: Path) -> None:
    """The mounted settings file and the container's environment (image ENV, then the
    manifest's env and secrets) pass load_settings, and no variable contradicts the file."""
    settings, env, text = overlay_settings(overlay, tmp_path)
    from_file = load_with({}, text, tmp_path)
    written = yaml.safe_load(text)
    for name, value in env.items():
        path = name.removeprefix("LORAPLEX_").lower().split("__")
        if name.startswith("LORAPLEX_") and _written(written, path):
            assert _get(settings, path) == _get(from_file, path), (
                f"{name}={value} overrides {'.'.join(path)} of the settings file"
            )
    mounts = {m["mountPath"] for m in server_container(render(overlay))["volumeMounts"]}
    assert str(settings.cache_dir) in mounts


def _written(values: object, path: list[str]) -> bool:
    for part in path:
        if not isinstance(values, dict) or part not in values:
            return False
        values = values[part]
    return True


def _get(settings: object, path: list[str]) -> object:
    for part in path:
        settings = getattr(settings, part)
    return settings


def test_a_misspelt_settings_key_fails_the_load(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"http\.prot"):
        load_with({}, "http:\n  prot: 8000\n", tmp_path)


def _port_number(container: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


@pytest.mark.parametrize("overlay", ALL)
def test_probes_and_ports_match_the_server(overlay: str, tmp_path: Path) -> None:
    settings, _, _ = overlay_settings(overlay, tmp_path)
    routes = route_paths(app_for(settings))
    container = server_container(render(overlay))
    assert settings.http.host == "0.0.0.0"
    probes = {
        k: container[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == "/health"
    for probe in probes.values():
        assert probe["path"] in routes
        assert _port_number(container, probe["port"]) == settings.http.port
    objects = render(overlay)
    service = one(objects, "Service", "loraplex")
    assert [_port_number(container, p["targetPort"]) for p in service["spec"]["ports"]] == [
        settings.http.port
    ]
    pool = one(objects, "InferencePool", "loraplex")
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [settings.http.port]
    monitor = one(objects, "ServiceMonitor", "loraplex")
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] in routes
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_templates(objects: tuple[Obj, ...]) -> dict[str, Obj]:
    return {d["metadata"]["name"]: d["spec"]["template"] for d in of_kind(objects, "Deployment")}


@pytest.mark.parametrize("overlay", ALL)
def test_pool_and_services_select_their_own_pods(overlay: str) -> None:
    objects = render(overlay)
    labels = {n: t["metadata"]["labels"] for n, t in _pod_templates(objects).items()}
    selector = one(objects, "InferencePool", "loraplex")["spec"]["selector"]["matchLabels"]
    assert [n for n, pod in labels.items() if _selects(selector, pod)] == ["loraplex"]
    for name in ("loraplex", "loraplex-picker"):
        selector = one(objects, "Service", name)["spec"]["selector"]
        assert [n for n, pod in labels.items() if _selects(selector, pod)] == [name]


@pytest.mark.parametrize("overlay", ALL)
def test_monitor_scrapes_the_server_under_the_job_the_alerts_watch(overlay: str) -> None:
    objects = render(overlay)
    selector = one(objects, "ServiceMonitor", "loraplex")["spec"]["selector"]["matchLabels"]
    monitored = [
        s["metadata"]["name"]
        for s in of_kind(objects, "Service")
        if _selects(selector, s["metadata"]["labels"])
    ]
    assert monitored == ["loraplex"]
    # Prometheus Operator names the job after the Service: the rules' job matchers must hold.
    for rule in of_kind(objects, "PrometheusRule"):
        for job in re.findall(r'job="([^"]+)"', json.dumps(rule["spec"])):
            assert job in monitored, job


def _flags(container: Obj) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


@pytest.mark.parametrize("overlay", ALL)
def test_pool_reaches_the_picker_that_serves_it(overlay: str) -> None:
    objects = render(overlay)
    pool = one(objects, "InferencePool", "loraplex")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(objects, ref["kind"], ref["name"])
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    pod = _pod_templates(objects)["loraplex-picker"]["spec"]
    (epp,) = pod["containers"]
    flags = _flags(epp)
    assert _port_number(epp, port["targetPort"]) == int(flags["grpc-port"])
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert flags["pool-group"] == pool["apiVersion"].split("/")[0]
    config_dir = str(Path(flags["config-file"]).parent)
    mount = next(m for m in epp["volumeMounts"] if m["mountPath"] == config_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = one(objects, "ConfigMap", volume["configMap"]["name"])
    assert Path(flags["config-file"]).name in config_map["data"]
    # The picker outlives the replicas' drain.
    grace = {
        n: t["spec"]["terminationGracePeriodSeconds"] for n, t in _pod_templates(objects).items()
    }
    assert grace["loraplex-picker"] >= grace["loraplex"]


@pytest.mark.parametrize("overlay", ALL)
def test_route_objectives_and_rewrites_name_the_pool(overlay: str) -> None:
    objects = render(overlay)
    pool = ("InferencePool", one(objects, "InferencePool", "loraplex")["metadata"]["name"])
    for route in of_kind(objects, "HTTPRoute"):
        for rule in route["spec"]["rules"]:
            assert [(b["kind"], b["name"]) for b in rule["backendRefs"]] == [pool]
    for kind in ("InferenceObjective", "InferenceModelRewrite"):
        for obj in of_kind(objects, kind):
            assert (obj["spec"]["poolRef"]["kind"], obj["spec"]["poolRef"]["name"]) == pool


def _picker_config(objects: tuple[Obj, ...]) -> Obj:
    config = next(c for c in of_kind(objects, "ConfigMap") if "picker-config.yaml" in c["data"])
    return dict(yaml.safe_load(config["data"]["picker-config.yaml"]))


def _metrics_extractor(objects: tuple[Obj, ...]) -> Obj:
    plugins = _picker_config(objects)["plugins"]
    return dict(next(p for p in plugins if p["type"] == "core-metrics-extractor"))


@pytest.mark.parametrize("overlay", ALL)
def test_picker_scores_lora_affinity_and_queue_on_loraplex_metrics(overlay: str) -> None:
    objects = render(overlay)
    config = _picker_config(objects)
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    profile = next(p for p in config["schedulingProfiles"] if p["name"] == "default")
    scorers = {plugins[p["pluginRef"]]["type"] for p in profile["plugins"]}
    assert {"lora-affinity-scorer", "queue-scorer"} <= scorers
    extractor = _metrics_extractor(objects)
    engines = {e["name"]: e for e in extractor["parameters"]["engineConfigs"]}
    labels = server_deployment(objects)["spec"]["template"]["metadata"]["labels"]
    engine = engines[labels["llm-d.ai/engine-type"]]
    assert extractor["parameters"]["defaultEngine"] == labels["llm-d.ai/engine-type"]
    for spec in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec"):
        assert engine[spec], spec


@pytest.mark.parametrize("overlay", ALL)
def test_picker_scrapes_the_metrics_listener_without_a_token(overlay: str, tmp_path: Path) -> None:
    """The picker sends no token: it reads /metrics/picker on the listener that asks none
    (http.metrics_port, bound where the picker can reach it), and every name its config reads
    is served there."""
    settings, _, _ = overlay_settings(overlay, tmp_path)
    objects = render(overlay)
    source = next(
        p for p in _picker_config(objects)["plugins"] if p["type"] == "metrics-data-source"
    )["parameters"]
    assert source["path"] == PICKER_METRICS_PATH and source["scheme"] == "http"
    assert source["port"] == settings.http.metrics_port
    assert settings.http.metrics_host == "0.0.0.0"
    ports = {p["containerPort"] for p in server_container(objects)["ports"]}
    assert settings.http.metrics_port in ports
    app = app_for(settings)
    client = TestClient(app, base_url=f"http://testserver:{settings.http.metrics_port}")
    response = client.get(PICKER_METRICS_PATH)
    assert response.status_code == 200, response.text
    served = {f.name for f in text_string_to_metric_families(response.text)}
    served |= set(PICKER_ENGINE_FAMILIES)  # vLLM's, once the engine runs
    assert set(PICKER_ENGINE_FAMILIES) <= vllm_metric_names()
    read = metric_names_in(json.dumps(_metrics_extractor(objects)["parameters"]))
    assert read and read <= served, read - served


EPP_FLAGS = {
    line
    for line in (CRD_DIR / "epp-flags.txt").read_text().splitlines()
    if line and not line.startswith("#")
}


@pytest.mark.parametrize("overlay", ALL)
def test_picker_flags_exist_in_its_release(overlay: str) -> None:
    """Every flag the picker's Deployment passes is one its image defines (an unknown flag
    stops it at start)."""
    pod = _pod_templates(render(overlay))["loraplex-picker"]["spec"]
    (epp,) = pod["containers"]
    assert set(_flags(epp)) <= EPP_FLAGS, set(_flags(epp)) - EPP_FLAGS


@pytest.mark.parametrize("overlay", ALL)
def test_metric_names_in_rules_autoscaler_and_picker_are_exposed(
    overlay: str, tmp_path: Path
) -> None:
    settings, _, _ = overlay_settings(overlay, tmp_path)
    exposed = loraplex_metric_names(app_for(settings)) | vllm_metric_names()
    objects = render(overlay)
    used: dict[str, set[str]] = {}
    for rule in of_kind(objects, "PrometheusRule"):
        used[rule["metadata"]["name"]] = metric_names_in(json.dumps(rule["spec"]))
    for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
        metrics = hpa["spec"]["metrics"]
        used[hpa["metadata"]["name"]] = {m["pods"]["metric"]["name"] for m in metrics}
    used["picker"] = metric_names_in(json.dumps(_metrics_extractor(objects)["parameters"]))
    assert all(used.values()), used
    for where, names in used.items():
        assert names <= exposed, f"{where}: {sorted(names - exposed)} not exposed by the server"


def test_metric_names_come_from_the_server_code(tmp_path: Path) -> None:
    """The names the check above trusts: loraplex's and vLLM's own, not a list kept here."""
    names = loraplex_metric_names(app_for(load_with({}, None, tmp_path)))
    assert {"loraplex_requests_queued", "loraplex_requests_total"} <= names
    assert "loraplex_adapter_loads_total" in names  # the adapter registry's
    vllm = vllm_metric_names()
    assert {"vllm:num_requests_waiting", "vllm:lora_requests_info"} <= vllm
    assert {"vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_bucket"} <= vllm


@pytest.mark.parametrize("overlay", ALL)
def test_route_exposes_the_openai_api_only(overlay: str, tmp_path: Path) -> None:
    settings, _, _ = overlay_settings(overlay, tmp_path)
    routes = route_paths(app_for(settings))
    prefixes = [
        m["path"]["value"]
        for route in of_kind(render(overlay), "HTTPRoute")
        for rule in route["spec"]["rules"]
        for m in rule["matches"]
    ]
    reachable = {r for r in routes if any(r.startswith(p) for p in prefixes)}
    assert reachable == {"/v1/chat/completions", "/v1/completions", "/v1/models"}


def test_canary_rewrites_one_adapter_between_two_of_its_versions() -> None:
    for rewrite in of_kind(render("base"), "InferenceModelRewrite"):
        for rule in rewrite["spec"]["rules"]:
            for match in rule["matches"]:
                name = check_name(match["model"]["value"])
                targets = [parse_ref(t["modelRewrite"]) for t in rule["targets"]]
                assert {t.name for t in targets} == {name}
                versions = [t.version for t in targets]
                assert None not in versions and len(set(versions)) == len(versions) >= 2


@pytest.mark.parametrize("overlay", ALL)
def test_containers_run_unprivileged_on_a_read_only_root(overlay: str, tmp_path: Path) -> None:
    objects = render(overlay)
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
    container = server_container(objects)
    pod = server_deployment(objects)["spec"]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == dockerfile_user(image_dockerfile(container))
    # Where the server writes: cache_dir, HOME (caches of vLLM, torch, Triton), the Hugging Face
    # cache, the compile caches and /tmp, each on a writable volume.
    settings, env, _ = overlay_settings(overlay, tmp_path)
    writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
    paths = (settings.cache_dir, env["HOME"], env["HF_HOME"], *(env[n] for n in COMPILE_CACHES),
             "/tmp")  # fmt: skip
    for path in map(str, paths):
        assert any(lies_under(path, w) for w in writable), path


def _volume_at(pod: Obj, container: Obj, path: str) -> Obj:
    """The pod's volume whose mount in `container` holds `path` (the deepest mount wins)."""
    mounts = [m for m in container["volumeMounts"] if lies_under(path, m["mountPath"])]
    assert mounts, f"{path} is on no volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    assert not mount.get("readOnly"), f"{path} is on a read-only mount"
    return next(v for v in pod["volumes"] if v["name"] == mount["name"])


def _claim_of(objects: tuple[Obj, ...], volume: Obj) -> Obj | None:
    """The PersistentVolumeClaim a pod volume names, None for any other volume (an emptyDir,
    an ephemeral claim made and deleted with the pod)."""
    if not volume.get("persistentVolumeClaim"):
        return None
    return one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


def _compile_cache_volumes(overlay: str, tmp_path: Path) -> tuple[tuple[Obj, ...], dict[str, Obj]]:
    objects = render(overlay)
    container = server_container(objects)
    pod = server_deployment(objects)["spec"]["template"]["spec"]
    _, env, _ = overlay_settings(overlay, tmp_path)
    for name in COMPILE_CACHES:
        assert name in env, f"the server container sets no {name}"
    return objects, {name: _volume_at(pod, container, env[name]) for name in COMPILE_CACHES}


@pytest.mark.parametrize("overlay", ALL)
def test_kernel_caches_outlive_the_pod(overlay: str, tmp_path: Path) -> None:
    """Triton's and Inductor's kernels lie on a claim that outlives the pod (not an emptyDir or
    a claim made and deleted with it), so a restarted or new replica loads them instead of
    compiling; where the autoscaler allows several replicas, one claim they all mount
    (ReadWriteMany), so a rollout's new pods start warm."""
    objects, volumes = _compile_cache_volumes(overlay, tmp_path)
    shared = _max_replicas(objects) > 1
    for name in KERNEL_CACHES:
        claim = _claim_of(objects, volumes[name])
        assert claim is not None, (name, volumes[name])
        if shared:
            assert claim["spec"]["accessModes"] == ["ReadWriteMany"], (name, claim)


@pytest.mark.parametrize("overlay", ALL)
def test_vllm_compile_cache_is_one_replicas_own(overlay: str, tmp_path: Path) -> None:
    """vLLM 0.26 rewrites its compile cache's index in place and reads it at start unguarded
    (vllm/compilation/backends.py), so two replicas never share it: with one replica it lies
    on the claim that outlives the pod; with several, on a volume of each pod's own."""
    objects, volumes = _compile_cache_volumes(overlay, tmp_path)
    claim = _claim_of(objects, volumes["VLLM_CACHE_ROOT"])
    if _max_replicas(objects) > 1:
        assert claim is None or "ReadWriteMany" not in claim["spec"]["accessModes"], claim
    else:
        assert claim is not None, volumes["VLLM_CACHE_ROOT"]


def _startup_budget_s(container: Obj) -> int:
    probe = container["startupProbe"]
    return int(probe["periodSeconds"] * probe["failureThreshold"])


def _healthcheck_start_period_s(dockerfile: Path) -> int:
    found = re.search(r"--start-period=(\d+)s", dockerfile.read_text())
    assert found, f"{dockerfile} has no HEALTHCHECK start period"
    return int(found.group(1))


def _measured_startups_s() -> list[float]:
    rows = []
    for path in (REPO / "bench" / "e2e" / "results").glob("*.jsonl"):
        rows += [float(s) for s in re.findall(r'"startup_s":\s*([0-9.]+)', path.read_text())]
    return rows


@pytest.mark.parametrize("overlay", ALL)
def test_startup_probe_allows_the_engine_start(overlay: str) -> None:
    container = server_container(render(overlay))
    budget = _startup_budget_s(container)
    assert budget >= _healthcheck_start_period_s(image_dockerfile(container))
    measured = _measured_startups_s()
    assert measured and budget >= 2 * max(measured), (budget, max(measured))


@pytest.mark.parametrize("overlay", ALL)
def test_grace_period_covers_pause_drain_and_engine_stop(overlay: str, tmp_path: Path) -> None:
    """Kubernetes kills the pod at terminationGracePeriodSeconds, counted from the preStop
    pause: after it, the drain (http.drain_s) and the engine's stop must still fit."""
    settings, _, _ = overlay_settings(overlay, tmp_path)
    objects = render(overlay)
    pod = server_deployment(objects)["spec"]["template"]["spec"]
    pause = server_container(objects)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert settings.http.drain_s > 0
    assert pod["terminationGracePeriodSeconds"] > pause + shutdown_budget_s(settings)


def _max_replicas(objects: tuple[Obj, ...]) -> int:
    deployment = server_deployment(objects)
    counts = [deployment["spec"].get("replicas", 1)]
    for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
        if hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]:
            counts.append(hpa["spec"]["maxReplicas"])
    return max(counts)


@pytest.mark.parametrize("overlay", ALL)
def test_replicas_share_a_store_and_never_a_cache_dir(overlay: str, tmp_path: Path) -> None:
    """Several replicas need registry.store (each keeps its own catalog otherwise) and a
    cache_dir volume each; one replica on a shared claim must stop before the next starts."""
    objects = render(overlay)
    settings, _, _ = overlay_settings(overlay, tmp_path)
    deployment = server_deployment(objects)
    pod = deployment["spec"]["template"]["spec"]
    mounts = server_container(objects)["volumeMounts"]
    mount = next(m for m in mounts if m["mountPath"] == str(settings.cache_dir))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    if _max_replicas(objects) > 1:
        assert settings.registry.store is not None
        assert "persistentVolumeClaim" not in volume, "replicas would share one cache_dir"
    else:
        assert deployment["spec"]["strategy"]["type"] == "Recreate"
