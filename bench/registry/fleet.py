"""The catalog at fleet scale: replicas following one bucket's catalog of adapters and its tenants.

    python -m bench.registry.fleet [--adapters 1000 10000] [--tenants 10] [--replicas 32]
                                   [--idle-s 60] [--registrations 30] [--tenant-changes 30]
                                   [--new-replicas 3] [--reference COMMIT]

For each catalog size and tenant count, on a fresh moto S3 server in a process of its own that
counts every request by client (`bench.registry.counting_s3`):

1. Seed: N adapters through the catalog's own write path. Each adapter's two files (the same
   config, its own random rank-8 weights) go to their content addresses, its `register` event
   (the record `register()` builds) is appended with `Catalog.write_event`, and a snapshot is
   written every `SNAPSHOT_EVERY` events, as `CatalogSync.append` does; 16 writes at a time.
   Not through `register()` itself: that fetches, validates and hashes a folder per adapter
   (the probes below take ~0.1 s each here), and followers never read the weights. T tenants,
   each with a key (`fleet_tenants.seed_tenants`).
2. Fleet: a tenant writer, then `--replicas` processes (`bench.registry.fleet_replica`: the
   server's own registry and poll loop on a stub engine, and its tenant directory following the
   store), each signing S3 requests with its own access key.
3. Idle: every replica's S3 requests over `--idle-s` with nothing changing, and the CPU time the
   replicas and the S3 server spent meanwhile.
4. Propagation: a writer registry in this process registers `--registrations` new adapters through
   `register()` (fetch, validate, publish, append), one after another, a random 0-`poll_interval`
   pause apart. Reach: from `register()` returning to a replica's catalog knowing the name; per
   replica and registration, and per registration its slowest replica ("all").
   Then the tenant writer makes `--tenant-changes` changes (create, weight, quotas, a key,
   delete: `fleet_tenants`), the same way: from the writer's answer to a replica's directory
   showing the change.
5. Start-up of a new replica while the fleet polls, `--new-replicas` times: seconds to open the
   registry (in its process), seconds from spawn (with Python's imports), its S3 requests.

With `--reference COMMIT`, every catalog size runs twice, first with the followers (replicas)
of that commit (its tree from `git archive`), then with this tree's, side by side in one run; the
registry writer and the seeding are this tree's in both (the log's format is the same); the
tenant writer is a replica of the followers' tree.

Prints a table and appends one JSON row per catalog size, tenant count and follower to
bench/results/registry_fleet.jsonl.
Targets (issue 42): a registration or a tenant change on every replica within 5 s p99; idle S3
requests per replica independent of the catalog's size and of the number of tenants.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import httpx
import numpy as np
from prometheus_client import CollectorRegistry
from rich.console import Console
from rich.table import Table
from safetensors.numpy import save

from bench.common import append_rows, stamp
from bench.registry.counting_s3 import COUNTS_PATH
from bench.registry.fleet_replica import WATCH_S, probe_name
from bench.registry.fleet_tenants import seed_tenants
from bench.registry.stubs import TINY_MODEL_NAME, StubEngine, write_tiny_adapter, write_tiny_model
from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.catalog import SNAPSHOT_EVERY, SNAPSHOT_PREFIX, Catalog, blob_key
from loraplex.adapters_registry.events import Registered
from loraplex.adapters_registry.lifecycle import build_registry
from loraplex.adapters_registry.records import FileEntry, VersionRecord
from loraplex.adapters_registry.s3_store import S3Store
from loraplex.adapters_registry.settings import RegistrySettings

REPO = Path(__file__).resolve().parents[2]
BUCKET, PREFIX = "fleet-bench", "shared"
REACH_TIMEOUT_S = 30.0  # a change not on every replica by then counts as never arriving
SEED_WRITERS = 16
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_CREDENTIALS = {"AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def nearest_rank(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def with_key(client: str) -> dict[str, str]:
    """This process's environment with `client` as the S3 access key id (how the server counts)."""
    return {**os.environ, **_CREDENTIALS, "AWS_ACCESS_KEY_ID": client}


class S3Server:
    """`bench.registry.counting_s3` in its own process (no GIL shared with the bench)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.registry.counting_s3"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.endpoint: str = json.loads(self.proc.stdout.readline())["endpoint"]

    def counts(self) -> collections.Counter[str]:
        return collections.Counter(httpx.get(self.endpoint + COUNTS_PATH, timeout=30).json())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def by_client(delta: collections.Counter[str]) -> dict[str, collections.Counter[str]]:
    """{client: {"KIND STATUS": n}} from the server's counts."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for key, n in delta.items():
        client, kind = key.split(" ", 1)
        out[client][kind] += n
    return out


class Replica:
    """One `fleet_replica` process and what it reported."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, spawned: float) -> None:
        self.name, self.proc, self.spawned = name, proc, spawned
        self.ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.ready_at = math.nan
        # {"seen" | "tenant_seen" | "changed": {k: time.monotonic() of the report}}
        self.reports: dict[str, dict[int, float]] = collections.defaultdict(dict)
        self._news = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, name: str, config: dict[str, Any], caches: Path, tree: Path) -> Replica:
        """Replica `name` of the source `tree` with `config` (see fleet_replica) and its own
        cache under `caches`."""
        spawned = time.monotonic()
        own = json.dumps(config | {"cache_root": str(caches / name)})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.registry.fleet_replica", own, cwd=tree,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=with_key(name),
        )  # fmt: skip
        return cls(name, proc, spawned)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            message = json.loads(line)
            if "ready" in message:
                self.ready_at = time.monotonic()
                self.ready.set_result(message)
            else:
                (kind,) = message.keys() - {"at"}
                async with self._news:
                    self.reports[kind][int(message[kind])] = float(message["at"])
                    self._news.notify_all()
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(f"replica {self.name} exited before ready"))

    async def wait_report(self, kind: str, k: int) -> float:
        async with self._news:
            await self._news.wait_for(lambda: k in self.reports[kind])
        return self.reports[kind][k]

    async def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        await self.proc.wait()
        await self._reader


def seed_catalog(store: S3Store, adapters: int) -> int:
    """Write `adapters` registrations (see the module docstring); the last snapshot's bytes."""
    catalog = Catalog(store)
    config = json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
                         "target_modules": ["q_proj"], "bias": "none"}).encode()  # fmt: skip
    config_sha = hashlib.sha256(config).hexdigest()
    rng = np.random.default_rng(0)
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    blobs: dict[str, bytes] = {config_sha: config}
    events: list[tuple[int, Registered]] = []
    snapshots: list[dict[str, Any]] = []
    for seq in range(1, adapters + 1):
        name = f"team{seq % 100:02d}/adapter-{seq:05d}"
        weights = save({
            f"{module}.lora_A.weight": rng.standard_normal((8, 32)).astype(np.float16),
            f"{module}.lora_B.weight": rng.standard_normal((32, 8)).astype(np.float16),
        })  # fmt: skip
        weights_sha = hashlib.sha256(weights).hexdigest()
        blobs[weights_sha] = weights
        files = (FileEntry("adapter_config.json", config_sha, len(config)),
                 FileEntry("adapter_model.safetensors", weights_sha, len(weights)))  # fmt: skip
        record = VersionRecord(
            name, hashlib.sha256(config + weights).hexdigest(), catalog.next_engine_id(), 8,
            files, TINY_MODEL_NAME, f"s3://uploads/{name}/", time.time(),
        )  # fmt: skip
        event = Registered(name=name, record=record, pinned=False)
        catalog.apply(seq, event)
        events.append((seq, event))
        if seq % SNAPSHOT_EVERY == 0:
            snapshots.append(catalog.snapshot())

    def write_event(item: tuple[int, Registered]) -> None:
        if not catalog.write_event(*item):
            raise RuntimeError(f"seeding found event {item[0]} taken")

    with ThreadPoolExecutor(SEED_WRITERS) as pool:
        list(pool.map(lambda b: store.put_bytes(blob_key(b[0]), b[1]), blobs.items()))
        list(pool.map(write_event, events))
        list(pool.map(catalog.write_snapshot, snapshots))
    keys = store.list_keys(SNAPSHOT_PREFIX)
    return store.size(keys[-1]) if keys else 0


def make_bucket(endpoint: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="setup", aws_secret_access_key="testing")  # fmt: skip
    client.create_bucket(Bucket=BUCKET)


async def open_writer(settings: RegistrySettings, model_dir: Path, caches: Path) -> ManagedRegistry:
    os.environ.update(with_key("writer"))  # boto3 reads the key when the store is opened
    return await build_registry(
        settings, StubEngine(), model_dir=model_dir, base_model_name=TINY_MODEL_NAME,
        max_lora_rank=64, max_loras=4, max_cpu_loras=8, cache_root=caches / "writer",
        metrics_registry=CollectorRegistry(),
    )  # fmt: skip


async def measure_idle(s3: S3Server, fleet: list[Replica], idle_s: float) -> dict[str, Any]:
    pids = [r.proc.pid for r in fleet]
    before, cpu_before, s3_cpu_before = s3.counts(), [cpu_s(p) for p in pids], cpu_s(s3.proc.pid)
    await asyncio.sleep(idle_s)
    after, cpu_after, s3_cpu_after = s3.counts(), [cpu_s(p) for p in pids], cpu_s(s3.proc.pid)
    clients = by_client(after - before)
    per_min = [sum(clients[r.name].values()) * 60 / idle_s for r in fleet]
    kinds: collections.Counter[str] = collections.Counter()
    for r in fleet:
        kinds.update(clients[r.name])
    return {
        "requests_per_replica_min": statistics.fmean(per_min),
        "requests_per_replica_min_range": [min(per_min), max(per_min)],
        "by_kind_per_replica_min": {
            k: n * 60 / idle_s / len(fleet) for k, n in sorted(kinds.items())
        },
        "replica_cpu_ms_per_min": statistics.fmean(
            (a - b) * 1000 * 60 / idle_s for a, b in zip(cpu_after, cpu_before, strict=True)
        ),
        "s3_server_cpu_share": (s3_cpu_after - s3_cpu_before) / idle_s,
    }


async def reach_delays(fleet: list[Replica], kind: str, k: int, acked: float) -> list[float]:
    """Each replica's delay from `acked` to its report `kind` of change k (inf: none in time)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(
            asyncio.gather(*(r.wait_report(kind, k) for r in fleet)), REACH_TIMEOUT_S
        )
    return [r.reports[kind].get(k, math.inf) - acked for r in fleet]


async def measure_reach(
    writer: ManagedRegistry, fleet: list[Replica], work: Path, count: int, pause_s: float
) -> dict[str, Any]:
    rng = random.Random(0)
    delays: list[list[float]] = []
    register_s: list[float] = []
    for k in range(count):
        folder = write_tiny_adapter(work / "probes" / str(k), seed=k)
        start = time.monotonic()
        await writer.register(probe_name(k), str(folder))
        acked = time.monotonic()
        register_s.append(acked - start)
        delays.append(await reach_delays(fleet, "seen", k, acked))
        await asyncio.sleep(rng.uniform(0, pause_s))
    return {**reach_stats(delays), "register_p50_s": nearest_rank(register_s, 0.5)}


async def measure_tenant_reach(
    writer: Replica, fleet: list[Replica], count: int, pause_s: float
) -> dict[str, Any]:
    rng = random.Random(1)
    delays: list[list[float]] = []
    for k in range(count):
        await writer.send(f"change {k}")
        acked = await writer.wait_report("changed", k)
        delays.append(await reach_delays(fleet, "tenant_seen", k, acked))
        await asyncio.sleep(rng.uniform(0, pause_s))
    return reach_stats(delays)


def reach_stats(delays: list[list[float]]) -> dict[str, Any]:
    """Per change its slowest replica ("all") and every replica's delay ("each")."""
    slowest = [max(d) for d in delays]
    each = [x for d in delays for x in d]
    return {
        "all_s": [round(d, 3) for d in slowest],
        "all_p50_s": nearest_rank(slowest, 0.5),
        "all_p99_s": nearest_rank(slowest, 0.99),
        "each_p50_s": nearest_rank(each, 0.5),
        "each_p99_s": nearest_rank(each, 0.99),
        "each_min_s": min(each),
        "missing": sum(1 for d in each if math.isinf(d)),
    }


async def measure_new_replica(
    s3: S3Server, config: dict[str, Any], caches: Path, tree: Path, n: int
) -> dict[str, Any]:
    opened, spawned, requests = [], [], []
    for j in range(n):
        replica = await Replica.start(f"new{j}", config, caches, tree)
        message = await replica.ready
        counted = by_client(s3.counts())[replica.name]
        await replica.close()
        opened.append(float(message["ready"]))
        spawned.append(replica.ready_at - replica.spawned)
        requests.append(dict(counted))
    return {
        "open_s_median": statistics.median(opened),
        "open_s": opened,
        "spawn_to_ready_s_median": statistics.median(spawned),
        "requests": requests,
    }


async def run_size(
    adapters: int, tenants: int, tree: Path, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    """One catalog size and tenant count with the followers of source `tree`."""
    load_before = os.getloadavg()
    s3 = S3Server()
    fleet: list[Replica] = []
    tenant_writer: Replica | None = None
    try:
        make_bucket(s3.endpoint)
        store_uri = f"s3://{BUCKET}/{PREFIX}"
        settings = RegistrySettings(store=store_uri, s3_endpoint_url=s3.endpoint,
                                    poll_interval_s=args.poll_interval_s)  # fmt: skip
        os.environ.update(with_key("seeder"))
        start = time.perf_counter()
        seed_store = S3Store(BUCKET, PREFIX, settings)
        snapshot_bytes = await asyncio.to_thread(seed_catalog, seed_store, adapters)
        await asyncio.to_thread(seed_tenants, seed_store, tenants)
        seed_s = time.perf_counter() - start
        size = f"[{adapters}, {tenants}]"
        print(f"{size} seeded in {seed_s:.1f} s; starting {args.replicas} replicas", flush=True)
        config = {
            "store": store_uri,
            "endpoint": s3.endpoint,
            "poll_interval_s": args.poll_interval_s,
            "model_dir": str(work / "model"),
        }
        caches = Path(tempfile.mkdtemp(prefix="caches-", dir=work))
        tenant_writer = await Replica.start("tenant-writer", config, caches, tree)
        await tenant_writer.ready
        fleet = [
            await Replica.start(f"replica{i:02d}", config, caches, tree)
            for i in range(args.replicas)
        ]
        ready = await asyncio.gather(*(r.ready for r in fleet))
        assert all((m["adapters"], m["tenants"]) == (adapters, tenants) for m in ready), ready
        fleet_open = [float(m["ready"]) for m in ready]
        await asyncio.sleep(2 * args.poll_interval_s)  # past every replica's first poll
        print(f"{size} fleet up; idle for {args.idle_s:.0f} s", flush=True)
        idle = await measure_idle(s3, fleet, args.idle_s)
        print(f"{size} {args.registrations} registrations", flush=True)
        for replica in fleet:
            await replica.send("watch")
        writer = await open_writer(settings, work / "model", caches)
        try:
            reach = await measure_reach(writer, fleet, caches / "probes",
                                        args.registrations, args.poll_interval_s)  # fmt: skip
        finally:
            writer.cache.close()
        print(f"{size} {args.tenant_changes} tenant changes", flush=True)
        tenant_reach = await measure_tenant_reach(
            tenant_writer, fleet, args.tenant_changes, args.poll_interval_s
        )
        print(f"{size} {args.new_replicas} new replicas", flush=True)
        new = await measure_new_replica(s3, config, caches, tree, args.new_replicas)
    finally:
        for r in [*fleet, *([tenant_writer] if tenant_writer else [])]:
            await r.close()
        s3.close()
    return {
        "adapters": adapters,
        "tenants": tenants,
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "seed_s": seed_s,
        "snapshot_bytes": snapshot_bytes,
        "fleet_open_s": {"median": statistics.median(fleet_open), "max": max(fleet_open)},
        "idle": idle,
        "reach": reach,
        "tenant_reach": tenant_reach,
        "new_replica": new,
    }


def show(results: list[dict[str, Any]], replicas: int) -> Table:
    table = Table(title=f"catalog followers: {replicas} replicas on one moto bucket")
    for col in ("adapters", "tenants", "follower", "reach all p50/p99 s", "reach each p50/p99 s",
                "tenant reach all p50/p99 s", "idle req/replica/min", "replica CPU ms/min",
                "S3 server CPU", "new replica open s", "its S3 requests",
                "snapshot KiB"):  # fmt: skip
        table.add_column(col)
    for r in results:
        reach, tenant_reach, idle, new = r["reach"], r["tenant_reach"], r["idle"], r["new_replica"]
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in idle["by_kind_per_replica_min"].items())
        table.add_row(
            f"{r['adapters']:,}",
            f"{r['tenants']:,}",
            f"{r['follower']} {r['follower_commit']}",
            f"{reach['all_p50_s']:.2f} / {reach['all_p99_s']:.2f}",
            f"{reach['each_p50_s']:.2f} / {reach['each_p99_s']:.2f}",
            f"{tenant_reach['all_p50_s']:.2f} / {tenant_reach['all_p99_s']:.2f}",
            kinds,
            f"{idle['replica_cpu_ms_per_min']:.0f}",
            f"{idle['s3_server_cpu_share']:.0%}",
            f"{new['open_s_median']:.2f}",
            ", ".join(f"{k} {v}" for k, v in sorted(new["requests"][-1].items())),
            f"{r['snapshot_bytes'] / 1024:.0f}",
        )
    return table


def show_ratios(results: list[dict[str, Any]]) -> Table:
    """This tree's followers over the reference's, per catalog size and tenant count (below 1:
    this is less)."""
    table = Table(title="this / reference")
    for col in ("adapters", "tenants", "reach all p99", "tenant reach all p99",
                "idle req/replica", "replica CPU", "S3 server CPU",
                "new replica open"):  # fmt: skip
        table.add_column(col)
    ref = {(r["adapters"], r["tenants"]): r for r in results if r["follower"] == "reference"}
    for r in results:
        base = ref.get((r["adapters"], r["tenants"]))
        if r["follower"] != "this" or base is None:
            continue
        idle, base_idle = r["idle"], base["idle"]
        table.add_row(
            f"{r['adapters']:,}",
            f"{r['tenants']:,}",
            f"{r['reach']['all_p99_s'] / base['reach']['all_p99_s']:.2f}",
            f"{r['tenant_reach']['all_p99_s'] / base['tenant_reach']['all_p99_s']:.2f}",
            f"{idle['requests_per_replica_min'] / base_idle['requests_per_replica_min']:.2f}",
            f"{r['idle']['replica_cpu_ms_per_min'] / base['idle']['replica_cpu_ms_per_min']:.2f}",
            f"{r['idle']['s3_server_cpu_share'] / base['idle']['s3_server_cpu_share']:.2f}",
            f"{r['new_replica']['open_s_median'] / base['new_replica']['open_s_median']:.2f}",
        )
    return table


def export_tree(commit: str, dest: Path) -> Path:
    """The source tree of `commit` (git archive) in `dest`."""
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", commit], cwd=REPO, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed")
    return dest


def short_commit(commit: str) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", commit], cwd=REPO, check=True,
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip()


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    try:
        write_tiny_model(work / "model")
        followers = [("this", short_commit("HEAD"), REPO)]
        if args.reference:
            tree = export_tree(args.reference, work / "reference")
            followers.insert(0, ("reference", short_commit(args.reference), tree))
        results = []
        for adapters, tenants in itertools.product(args.adapters, args.tenants):
            for label, commit, tree in followers:
                row = await run_size(adapters, tenants, tree, args, work)
                results.append({"follower": label, "follower_commit": commit, **row})
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1_000, 10_000])
    parser.add_argument("--tenants", type=int, nargs="+", default=[10])
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--registrations", type=int, default=30)
    parser.add_argument("--tenant-changes", type=int, default=30)
    parser.add_argument("--new-replicas", type=int, default=3)
    parser.add_argument("--poll-interval-s", type=float,
                        default=RegistrySettings().poll_interval_s)  # fmt: skip
    parser.add_argument("--reference", metavar="COMMIT",
                        help="also run the followers of this commit, first")  # fmt: skip
    args = parser.parse_args()
    results = asyncio.run(run(args))
    console = Console(width=160)
    console.print(show(results, args.replicas))
    if args.reference:
        console.print(show_ratios(results))
    config = {
        "replicas": args.replicas, "idle_s": args.idle_s, "registrations": args.registrations,
        "tenant_changes": args.tenant_changes, "new_replicas": args.new_replicas,
        "poll_interval_s": args.poll_interval_s, "snapshot_every": SNAPSHOT_EVERY,
        "seeded": "catalog write path (write_event, snapshots); tenants/<id>.json records",
        "reach_watch_s": WATCH_S,
    }  # fmt: skip
    rows = [{**stamp(), "bench": "registry_fleet", "config": config, **r} for r in results]
    console.print(f"wrote {append_rows('registry_fleet', rows)}")


if __name__ == "__main__":
    main()
