"""What every benchmark shares: the machine/commit stamp and the JSON-rows output."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def stamp() -> dict[str, Any]:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False)  # fmt: skip
        commit = done.stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return {
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "commit": commit,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def append_rows(name: str, rows: list[dict[str, Any]]) -> Path:
    """Append one JSON object per line to bench/results/<name>.jsonl."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
