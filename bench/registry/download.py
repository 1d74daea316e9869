"""Download throughput: loraplex's S3 fetch of one large object vs `aws s3 cp`, in one run.

    python -m bench.registry.download [--mib 512] [--repeats 3]

Starts moto's S3 server in its own process on 127.0.0.1 (so neither client shares a GIL with
the server), uploads one random object, then alternates the two clients `--repeats` times:

- loraplex: `DiskCache.fetch` through `S3Store` - the registry's real cold path: parallel ranged
  GETs (boto3 transfer manager, settings defaults), sha256 check, fsync, rename into the cache;
- reference: `aws s3 cp s3://.../obj FILE --endpoint-url ...` with the CLI's default settings.

Prints a table of median seconds and MiB/s, and appends JSON rows to
bench/results/registry_download.jsonl. The target is ratio (ours / aws) >= 0.9 in throughput.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import httpx
from prometheus_client import CollectorRegistry
from rich.console import Console
from rich.table import Table

from bench.common import append_rows, stamp
from loraplex.adapters_registry.disk_cache import DiskCache
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.records import FileEntry
from loraplex.adapters_registry.s3_store import S3Store
from loraplex.adapters_registry.settings import RegistrySettings

BUCKET, KEY = "bench-registry", "blobs/big"


def start_moto(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def ours(endpoint: str, work: Path, entry: FileEntry) -> float:
    settings = RegistrySettings(s3_endpoint_url=endpoint)
    store = S3Store(BUCKET, "", settings)
    cache = DiskCache(work / "cache", 4 * 1024**3, RegistryMetrics(CollectorRegistry()))
    start = time.perf_counter()
    path = cache.fetch("v", (entry,), lambda e, dest: store.download(KEY, dest))
    elapsed = time.perf_counter() - start
    assert (path / entry.name).stat().st_size == entry.size
    cache.close()
    shutil.rmtree(work / "cache")
    return elapsed


def aws_cp(endpoint: str, work: Path, size: int) -> float:
    dest = work / "aws.bin"
    aws = shutil.which("aws", path=str(Path(sys.executable).parent)) or "aws"
    start = time.perf_counter()
    subprocess.run(
        [aws, "s3", "cp", f"s3://{BUCKET}/{KEY}", str(dest), "--endpoint-url", endpoint,
         "--only-show-errors"], check=True,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    assert dest.stat().st_size == size
    dest.unlink()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    from bench.loadgen.server import free_port

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    moto = start_moto(port)
    work = Path(tempfile.mkdtemp(prefix="bench-registry-"))
    try:
        data_path = work / "src.bin"
        size = args.mib * 1024 * 1024
        with data_path.open("wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1024 * 1024))
        digest = hashlib.sha256(data_path.read_bytes()).hexdigest()
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket=BUCKET)
        s3.upload_file(str(data_path), BUCKET, KEY)
        data_path.unlink()
        entry = FileEntry("adapter_model.safetensors", digest, size)
        times: dict[str, list[float]] = {"loraplex": [], "aws s3 cp": []}
        for _ in range(args.repeats):
            times["loraplex"].append(ours(endpoint, work, entry))
            times["aws s3 cp"].append(aws_cp(endpoint, work, size))
    finally:
        moto.kill()
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["aws s3 cp"] / med["loraplex"]  # throughput ratio, ours / reference
    table = Table(title=f"S3 download of {args.mib} MiB from moto on loopback (median of "
                        f"{args.repeats})")  # fmt: skip
    for col in ("client", "seconds", "MiB/s", "runs (s)"):
        table.add_column(col)
    for name, t in times.items():
        table.add_row(name, f"{med[name]:.2f}", f"{args.mib / med[name]:.0f}",
                      " ".join(f"{x:.2f}" for x in t))  # fmt: skip
    console = Console()
    console.print(table)
    console.print(f"throughput ratio loraplex / aws s3 cp = {ratio:.2f} (target >= 0.9)")
    settings = RegistrySettings()
    config = {
        "mib": args.mib,
        "repeats": args.repeats,
        "chunk_mib": settings.transfer_chunk_mib,
        "max_concurrency": settings.transfer_max_concurrency,
        "includes_sha256": True,
    }
    path = append_rows("registry_download", [
        {**stamp(), "bench": "registry_download", "config": config,
         "ours_s": med["loraplex"], "reference_s": med["aws s3 cp"], "ratio": ratio,
         "runs": times},
    ])  # fmt: skip
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
