"""Fairness benchmark: does a flooding tenant push a light tenant's TTFT up?

Tenant B sends at `rate` req/s; tenant A at 8x that. Three runs on one machine, in one go:

1. `b_alone`    B alone, loraplex with fair dispatch (`tenancy.max_running` slots) and, on CPU,
                paced prefills (`engine.paced_prefill_tokens`).
2. `fair`       A and B together, same server.
3. `reference`  A and B together on a server that admits everything straight to the engine
                (`max_running` = `max_queued` = 4096, `engine_priority` off, vLLM's own
                scheduler: no gateway fairness, vLLM's first come, first served only).

Prints B's p90 TTFT in each and the ratios to B alone (target for `fair`: <= 1.5x), and appends
one row (machine, commit, config, the three runs' summaries) to `bench/results/fairness.jsonl`;
each run's chart and summary, and the servers' logs, go to `bench/results/tmp/fairness/`.

    python -m bench.fairness [--rate 0.5] [--duration 45] [--max-running 8] [--active-window S]
                             [--max-num-batched-tokens N] [--paced-prefill-tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.common import append_rows, stamp
from bench.loadgen.client import Sample, run_workload
from bench.loadgen.report import print_table, summarize, write_outputs
from bench.loadgen.server import LiveServer, live_server
from bench.loadgen.workload import Workload
from loraplex.server.tenancy.settings import TenancySettings

KEYS = {"a": "tenant-a-key-for-fairness-0123456789", "b": "tenant-b-key-for-fairness-0123456789"}
FLOOD_FACTOR = 8


def server_config(args: argparse.Namespace, *, gateway_fairness: bool = True) -> dict[str, Any]:
    """The fair server, or with `gateway_fairness` False the reference: everything admitted straight
    to the engine, which serves it first come, first served."""
    slots = args.max_running if gateway_fairness else 4096
    config: dict[str, Any] = {
        "tenancy": {
            "max_running": slots,
            "max_queued": 256 if gateway_fairness else 4096,
            "active_window_s": args.active_window,
            "engine_priority": gateway_fairness,
            "tenants": [{"id": t, "api_keys": [k]} for t, k in KEYS.items()],
        }
    }
    engine: dict[str, Any] = {}
    if args.max_num_batched_tokens is not None:
        engine["max_num_batched_tokens"] = args.max_num_batched_tokens
    if not gateway_fairness or args.paced_prefill_tokens == 0:
        engine["paced_prefill_tokens"] = None  # vLLM's own scheduler
    elif args.paced_prefill_tokens is not None:
        engine["paced_prefill_tokens"] = args.paced_prefill_tokens
    if engine:
        config["engine"] = engine
    return config


def workload(base_url: str, args: argparse.Namespace, tenants: list[str]) -> Workload:
    rates = {"a": args.rate * FLOOD_FACTOR, "b": args.rate}
    return Workload.model_validate(
        {
            "base_url": base_url,
            "duration_s": args.duration,
            "warmup_requests": 2,
            "drain_s": 10.0,
            "seed": 7,
            "tenants": [
                {
                    "name": t,
                    "api_key": KEYS[t],
                    "rate": rates[t],
                    "prompt_len": args.prompt_len,
                    "output_len": args.output_len,
                }
                for t in tenants
            ],
        }
    )


def server_side(server: LiveServer, samples: list[Sample], tenant: str) -> dict[str, float]:
    """Medians of the server's own queue time and TTFT for `tenant`'s measured requests."""
    ids = {s.request_id for s in samples if s.tenant == tenant and s.ok}
    lines = [json.loads(x) for x in server.log_text().splitlines() if x.startswith('{"request_id"')]
    mine = [x for x in lines if x["request_id"] in ids]
    return {
        "queue_ms_p50": float(np.median([x["queue_ms"] for x in mine])),
        "queue_ms_p90": float(np.percentile([x["queue_ms"] for x in mine], 90)),
        "ttft_ms_p50": float(np.median([x["ttft_ms"] for x in mine])),
    }


def tag(args: argparse.Namespace) -> str:
    """The run's settings, for file names."""
    budget = f"-tok{args.max_num_batched_tokens}" if args.max_num_batched_tokens else ""
    paced = "" if args.paced_prefill_tokens is None else f"-paced{args.paced_prefill_tokens}"
    return f"rate{args.rate:g}-mr{args.max_running}-win{args.active_window:g}{budget}{paced}"


def run(
    server: LiveServer, args: argparse.Namespace, tenants: list[str], name: str
) -> dict[str, Any]:
    wl = workload(server.base_url, args, tenants)
    samples: list[Sample]
    samples, wall_s = asyncio.run(run_workload(wl))
    summary = summarize(wl, samples, wall_s)
    summary["server_side"] = {t: server_side(server, samples, t) for t in tenants}
    print(f"{name}: server-side {summary['server_side']}")
    print_table(summary)
    stem = f"{name}-{summary['commit']}-{tag(args)}"
    write_outputs(summary, samples, args.out_dir / "tmp" / "fairness" / stem)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__)
    parser.add_argument("--rate", type=float, default=0.5, help="tenant B's requests per second")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds per run")
    parser.add_argument("--max-running", type=int, default=8, help="tenancy.max_running")
    parser.add_argument(
        "--active-window", type=float, default=TenancySettings().active_window_s,
        help="tenancy.active_window_s",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="engine.max_num_batched_tokens for both servers (vLLM's default if unset)",
    )  # fmt: skip
    parser.add_argument(
        "--paced-prefill-tokens", type=int, default=None,
        help="engine.paced_prefill_tokens for the fair server, 0 for none (unset: the server's "
        "default); the reference always has vLLM's own scheduler",
    )  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    runs: dict[str, dict[str, Any]] = {}
    logs = args.out_dir / "tmp" / "fairness"  # server logs (access lines) stay for inspection
    with live_server(server_config(args), logs / "fair") as server:
        runs["b_alone"] = run(server, args, ["b"], "b_alone")
        runs["fair"] = run(server, args, ["a", "b"], "fair")
    reference = server_config(args, gateway_fairness=False)
    with live_server(reference, logs / "reference") as server:
        runs["reference"] = run(server, args, ["a", "b"], "reference")

    alone = runs["b_alone"]["tenants"]["b"]["ttft_s"]["p90"]
    table = Table(title=f"B's p90 TTFT, A at {FLOOD_FACTOR}x B's offered load")
    for col in ("run", "B p90 TTFT ms", "vs B alone", "A out tok/s", "B out tok/s"):
        table.add_column(col, justify="right")
    rows = []
    for name, summary in runs.items():
        b = summary["tenants"]["b"]
        a = summary["tenants"].get("a")
        ratio = b["ttft_s"]["p90"] / alone
        rows.append({"run": name, "b_p90_ttft_s": b["ttft_s"]["p90"], "ratio_to_alone": ratio})
        table.add_row(
            name,
            f"{b['ttft_s']['p90'] * 1000:.1f}",
            f"{ratio:.2f}x",
            "-" if a is None else f"{a['output_tokens_per_s']:.1f}",
            f"{b['output_tokens_per_s']:.1f}",
        )
    Console(width=160).print(table)
    result = {
        **stamp(),
        "bench": "fairness",
        "config": {k: str(v) for k, v in vars(args).items()},
        "target": "fair ratio_to_alone <= 1.5",
        "rows": rows,
        "runs": runs,
    }
    print(f"wrote {append_rows('fairness', [result], args.out_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
