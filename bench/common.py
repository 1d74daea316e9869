"""What every benchmark shares: the machine/commit stamp and the JSON-rows output.

Result files follow one rule: `<results folder>/<name>.jsonl`, one JSON row a line, each row
stamped (machine, commit, config). `<name>` is the benchmark's name, lower case with
underscores (`registry_download`, `fairness`), and for GPU rows ends with the GPU's slug
(`moe_lora_nvidia_h200`): rows compare only on one GPU model. CPU benchmarks append to
`bench/results/`; GPU ones write into their run's `--out` folder, whose files are appended to
the committed ones of the same name in `bench/<kind>/results/`. docs/bench.md lists them.
"""

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


def append_rows(name: str, rows: list[dict[str, Any]], folder: Path = RESULTS) -> Path:
    """Append one JSON object per line to <folder>/<name>.jsonl (bench/results/ by default)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
