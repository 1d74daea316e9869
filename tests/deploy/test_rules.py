"""Prometheus rules, scrape config and Grafana dashboard checked with the real `promtool`.

Debian's `prometheus` package provides promtool (scripts/setup.sh installs it); these tests fail,
rather than skip, where it is missing, because CI must prove the deploy files valid.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "loraplex.json"


def promtool(*args: str, cwd: Path | None = None) -> str:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: install Debian's `prometheus` package (scripts/setup.sh)"
    done = subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def test_rule_files_pass_promtool_check() -> None:
    assert len(RULE_FILES) == 2
    out = promtool("check", "rules", *map(str, RULE_FILES))
    assert out.count("SUCCESS") == 2


def test_scrape_config_passes_promtool_check() -> None:
    promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))


def test_alerts_fire_on_synthetic_series() -> None:
    """promtool's rule unit tests: error ratio, TTFT SLO burn, engine down, load failures,
    quarantines, the quota store."""
    promtool("test", "rules", "rules_test.yml", cwd=Path(__file__).parent)


def test_every_alert_is_one_threshold_comparison() -> None:
    """The live Prometheus test evaluates each alert's signal with `bool`; keep that possible."""
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    assert len(signal_and_threshold(rule["expr"])) == 3, rule["alert"]


def signal_and_threshold(expr: str) -> list[str]:
    """`signal > threshold` -> [signal, '>', threshold] (the last top-level comparison)."""
    for op in (" == ", " > ", " < "):
        if op in expr:
            signal, _, threshold = expr.rpartition(op)
            return [signal, op.strip(), threshold]
    return [expr]


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every panel query, as a recording rule, must pass promtool's PromQL parser."""
    exprs = dashboard_exprs()
    assert len(exprs) >= 16
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": expr}
                    for i, (_, expr) in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    promtool("check", "rules", str(path))


def test_dashboard_covers_what_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    text = " ".join(expr for _, expr in dashboard_exprs())
    for needed in (
        "tenant:loraplex_generation_tokens:rate1m",
        "tenant:loraplex_time_to_first_token_seconds:p90_1m",
        "loraplex_requests_queued",
        "loraplex_rejections_total",
        "loraplex_adapter_resident",
        "loraplex_adapter_loads_total",
        "vllm:num_requests_running",
    ):
        assert needed in text, needed
    recorded = {
        rule["record"]
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "record" in rule
    }
    used = {word for word in text.replace("(", " ").split() if word.startswith("tenant:")}
    assert used <= recorded, used - recorded


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_rules_use_only_known_loraplex_metrics(path: Path) -> None:
    """A typo in a metric name makes a rule silently empty; the live test catches the rest."""
    known = (
        "loraplex_time_to_first_token_seconds",
        "loraplex_inter_token_latency_seconds",
        "loraplex_time_per_output_token_seconds",
        "loraplex_request_output_tokens_per_second",
        "loraplex_request_queue_time_seconds",
        "loraplex_generation_tokens_total",
        "loraplex_prompt_tokens_total",
        "loraplex_requests_total",
        "loraplex_adapter_load_failures_total",
        "loraplex_engine_healthy",
        "loraplex_adapters_quarantined",
        "loraplex_adapter_quarantines_total",
        "loraplex_quota_store_healthy",
    )
    for name in re.findall(r"(?<![:\w])(loraplex_[a-z_]+)", path.read_text()):
        assert name.startswith(known), name
