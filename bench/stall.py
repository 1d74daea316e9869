"""Stall benchmark: how much does one maximal request delay every other stream's tokens?

Steady streams (bench.stall_clock, a process of its own) decode from the base model while this
process sends maximal requests one after another, in phases of one kind each: the most work one
request can make the gateway do, by prompt, response or adapter registration
(bench.stall_attacks lists them).

Each attack phase follows a steady one, `--rounds` times per kind, so drift on a shared machine
hits both alike; the p99 inter-token latency (ITL) of each attack phase is compared with that
of the steady phase just before it, and a kind's row reports the median of its rounds (goal: at
most 50 ms higher, on the 2-core CPU machine) beside the phases pooled. Beside ITL, the latency
of a GET /health every 50 ms shows the gateway's event loop alone: a stall there is the
gateway's, a slower engine step is not (the response kinds add 16 sequences to the engine's
batch, which slows every step). The server admits 32 sequences at once (tenancy.max_running,
16 by default), so an n=16 request decodes beside the steady streams instead of waiting for all
of them to end. Prints a table, appends one JSON row per kind (machine, commit, config, the
load average over its phases) to bench/results/stall.jsonl.

The steady streams, the attacks and the scrape kind's seeding each send as their own tenants.
With `--reference COMMIT`, the same phases run first against a server of that commit's tree
(git archive), then against this tree's: a before/after in one run, side by side in the table.

    python -m bench.stall [--streams 4] [--phase-s 10] [--rounds 3] [--kinds chat_string,...]
                          [--reference COMMIT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from bench.common import append_rows, stamp
from bench.loadgen.server import ADMIN_TOKEN, LiveServer, live_server
from bench.registry.fleet import export_tree, short_commit
from bench.stall_attacks import (
    ATTACKER_KEY,
    KINDS,
    METRICS_KINDS,
    Attack,
    attacks,
    seed_metrics,
    seed_tenants,
)
from loraplex.server.settings import load_settings

GOAL_P99_INCREASE_S = 0.050
# A phase's gaps are those ending up to this long after its last reply (a stall ends when the
# request that caused it is answered); phases are twice this far apart.
SETTLE_S = 1.0
MAX_RUNNING = 32  # the steady streams and an n=16 request at once, with room to spare
# A short chat prompt takes about this many of the context's tokens (the template's included).
PROMPT_TOKENS = 32
STEADY_KEY = "stall-steady-key-0123456789"


@dataclass
class Phase:
    name: str  # `steady` or the kind sent
    server: str  # `this` tree or the `reference`
    start: float
    end: float = 0.0
    replies: list[tuple[int, float, int]] = field(default_factory=list)  # status, s, bytes
    gaps: list[float] = field(default_factory=list)  # the steady streams' ITL in the phase
    probes: list[float] = field(default_factory=list)  # GET /health latencies in the phase
    load: float = 0.0  # the machine's 1-minute load average at the phase's end


def send_for(server: LiveServer, phase: Phase, attack: Attack, duration: float) -> None:
    """`attack` one request after another until `duration` has passed (a request that takes
    longer ends the phase when it is answered)."""
    headers = {"Authorization": f"Bearer {ATTACKER_KEY}"}
    with httpx.Client(base_url=server.base_url, timeout=600, headers=headers) as client:
        while time.monotonic() - phase.start < duration:
            sent = time.monotonic()
            try:
                status, size = attack.send(client)
            except httpx.HTTPError:
                status, size = 0, 0  # the connection failed: counted as such in the table
            phase.replies.append((status, time.monotonic() - sent, size))
            time.sleep(0.2)


def gaps_ending_in(requests: list[list[float]], start: float, end: float) -> list[float]:
    """Inter-token gaps of every stream request whose later token came in [start, end]: a
    stall shows up in the phase where it ends, however long it was."""
    return [b - a for times in requests for a, b in itertools.pairwise(times) if start <= b <= end]


def run(args: argparse.Namespace) -> list[Phase]:
    """Every kind's phases against the reference's server (with `--reference`), then this
    tree's."""
    work = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    try:
        servers: list[tuple[str, Path | None]] = [("this", None)]
        if args.reference:
            servers.insert(0, ("reference", export_tree(args.reference, work / "reference")))
        return [phase for label, tree in servers for phase in run_on(args, label, tree)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_on(args: argparse.Namespace, label: str, tree: Path | None) -> list[Phase]:
    """`rounds` x (steady, kind) for each kind: each attack phase has a steady one just
    before it, so drift on a shared machine hits both alike."""
    settings = load_settings()  # what the server reads too: the defaults, this environment
    max_model_len = settings.engine.max_model_len
    response_tokens = args.response_tokens or max_model_len - PROMPT_TOKENS
    workdir = args.out_dir / "tmp" / "stall" / label
    seeded = seed_tenants()
    tenants = [{"id": "steady", "api_keys": [STEADY_KEY]},
               {"id": "mallory", "api_keys": [ATTACKER_KEY]}, *seeded]  # fmt: skip
    config = {"http": {"admin_token": ADMIN_TOKEN},
              "tenancy": {"max_running": MAX_RUNNING, "tenants": tenants}}  # fmt: skip
    phases: list[Phase] = []
    with live_server(config, workdir, tree=tree) as server:
        auth = {"Authorization": f"Bearer {STEADY_KEY}"}
        model = httpx.get(server.base_url + "/v1/models", headers=auth).json()["data"][0]["id"]
        sends = attacks(model, settings.http.max_body_bytes, max_model_len, response_tokens,
                        workdir, args.kinds)  # fmt: skip
        if any(k in METRICS_KINDS for k in args.kinds):
            seed_metrics(server.base_url, model, seeded)
        clock = subprocess.Popen(
            [sys.executable, "-m", "bench.stall_clock", "--base-url", server.base_url,
             "--model", model, "--streams", str(args.streams),
             "--max-tokens", str(args.max_tokens), "--api-key", STEADY_KEY],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert clock.stdin is not None and clock.stdout is not None
        assert clock.stdout.readline().strip() == "decoding"
        for _, kind in itertools.product(range(args.rounds), args.kinds):
            steady = Phase("steady", label, time.monotonic())
            time.sleep(args.phase_s)
            steady.end, steady.load = time.monotonic(), os.getloadavg()[0]
            time.sleep(2 * SETTLE_S)
            phase = Phase(kind, label, time.monotonic())
            send_for(server, phase, sends[kind], args.phase_s)
            phase.end, phase.load = time.monotonic(), os.getloadavg()[0]
            phases += [steady, phase]
            print(f"{label} {kind}: {len(phase.replies)} replies, load {phase.load:.1f}",
                  flush=True)  # fmt: skip
            time.sleep(2 * SETTLE_S)  # the last reply's aftermath is not the next phase's
        out, _ = clock.communicate("stop\n", timeout=120)
    clocked = json.loads(out)
    for phase in phases:
        end = phase.end + SETTLE_S
        phase.gaps = gaps_ending_in(clocked["requests"], phase.start, end)
        phase.probes = [s for sent, s in clocked["probes"] if phase.start <= sent + s <= end]
    return phases


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000


def _kind_row(kind: str, pairs: list[tuple[Phase, Phase]]) -> dict[str, Any]:
    """One kind's attack phases against the steady phases just before them: the median over
    the rounds of each round's p99 increase, and the phases pooled."""
    steady = [g for s, _ in pairs for g in s.gaps]
    attacked = [g for _, p in pairs for g in p.gaps]
    steady_probes = [x for s, _ in pairs for x in s.probes]
    attack_probes = [x for _, p in pairs for x in p.probes]
    statuses: dict[str, int] = {}
    for _, p in pairs:
        for status, _, _ in p.replies:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
    increases = [_ms(p.gaps, 99) - _ms(s.gaps, 99) for s, p in pairs]
    probe_increases = [_ms(p.probes, 99) - _ms(s.probes, 99) for s, p in pairs]
    loads = [phase.load for pair in pairs for phase in pair]
    return {
        "kind": kind,
        "rounds": len(pairs),
        "replies": statuses,
        "reply_s_max": max((t for _, p in pairs for _, t, _ in p.replies), default=None),
        "reply_bytes_max": max((b for _, p in pairs for _, _, b in p.replies), default=None),
        "gaps": {"steady": len(steady), "attack": len(attacked)},
        "p99_increase_ms": statistics.median(increases),
        "p99_increase_ms_rounds": increases,
        "goal_p99_increase_ms": GOAL_P99_INCREASE_S * 1000,
        "itl_p50_ms": {"steady": _ms(steady, 50), "attack": _ms(attacked, 50)},
        "itl_p99_ms": {"steady": _ms(steady, 99), "attack": _ms(attacked, 99)},
        "itl_max_ms": {"steady": _ms(steady, 100), "attack": _ms(attacked, 100)},
        "pooled_p99_increase_ms": _ms(attacked, 99) - _ms(steady, 99),
        "loop_probe_p99_increase_ms": statistics.median(probe_increases),
        "loop_probe_p99_ms": {"steady": _ms(steady_probes, 99), "attack": _ms(attack_probes, 99)},
        "loop_probe_max_ms": {
            "steady": _ms(steady_probes, 100),
            "attack": _ms(attack_probes, 100),
        },
        "load_avg_1m": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
    }


def report(args: argparse.Namespace, phases: list[Phase]) -> list[dict[str, Any]]:
    """One row per server and kind (`_kind_row`), and the table of them, the reference's row
    (with `--reference`) above this tree's."""
    title = (f"{args.streams} steady streams; maximal requests one after another, by kind "
             f"(median of {args.rounds} rounds, each attack phase against the steady one "
             "before it)")  # fmt: skip
    table = Table(title=title)
    columns = ("kind", "server", "replies", "reply MB", "steady p99 ms", "attack p99 ms",
               "p99 increase ms", "attack max ms", "loop p99 increase ms", "loop max ms",
               "load avg")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    rows = []
    base = {**stamp(), "config": {k: str(v) for k, v in vars(args).items()}}
    commits = {"this": base["commit"], "reference": args.reference and short_commit(args.reference)}
    for kind in args.kinds:
        for server in dict.fromkeys(p.server for p in phases):
            pairs = [(phases[i - 1], p) for i, p in enumerate(phases)
                     if p.name == kind and p.server == server]  # fmt: skip
            row = {**base, "server": server, "server_commit": commits[server],
                   **_kind_row(kind, pairs)}  # fmt: skip
            rows.append(row)
            load = row["load_avg_1m"]
            table.add_row(
                kind, f"{server} {commits[server]}",
                " ".join(f"{k}x{v}" for k, v in row["replies"].items()),
                f"{(row['reply_bytes_max'] or 0) / 1e6:.2f}",
                f"{row['itl_p99_ms']['steady']:.1f}", f"{row['itl_p99_ms']['attack']:.1f}",
                f"{row['p99_increase_ms']:+.1f}", f"{row['itl_max_ms']['attack']:.1f}",
                f"{row['loop_probe_p99_increase_ms']:+.1f}",
                f"{row['loop_probe_max_ms']['attack']:.1f}",
                f"{load['min']:.1f}-{load['max']:.1f}",
            )  # fmt: skip
    Console(width=220).print(table)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stall", description=__doc__)
    parser.add_argument("--streams", type=int, default=4, help="steady streams")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens per steady request")
    parser.add_argument("--phase-s", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=3, help="steady/attack pairs per kind")
    parser.add_argument(
        "--response-tokens", type=int, default=None,
        help="tokens per choice of the response kinds (default: to the end of the context)",
    )  # fmt: skip
    parser.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS))
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--reference", metavar="COMMIT",
                        help="also run every kind against this commit's server, first")  # fmt: skip
    args = parser.parse_args(argv)
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    rows = report(args, run(args))
    path = append_rows("stall", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
