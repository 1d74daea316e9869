"""Where the host's time goes, from py-spy's samples of bench_e2e.py's sampled prefills.

    python3 bench/e2e/host_samples.py SAMPLES.txt --row e2e_plugin.json --out ROW.json

SAMPLES.txt is `py-spy record --format raw --nolineno --idle` output: one line per distinct
stack, `frame;frame;...;leaf COUNT`. Only stacks through `timed_prefills` count. py-spy falls
behind its rate on vLLM's many threads (it took 54 samples in 3.9 s asked for 250/s), so a
frame's time is its share of those samples times the median prefill wall that the bench's row
records, in ms per prefill. `self` is by leaf frame: where the thread was, waits included (--idle
keeps the samples of a thread blocked in a synchronize or a launch). `inclusive` is by frame,
each counted once per stack.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

UNDER = "timed_prefills"


def read_stacks(path: Path) -> Counter[tuple[str, ...]]:
    """Stacks from the `timed_prefills` frame down, with their sample counts."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        frames_text, _, count = line.rpartition(" ")
        frames = frames_text.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith(UNDER + " ")), None)
        if at is not None and count.isdigit():
            stacks[tuple(frames[at:])] += int(count)
    return stacks


def summarize(stacks: Counter[tuple[str, ...]], wall_ms: float, top: int = 40) -> dict[str, Any]:
    total = sum(stacks.values())

    def ms(samples: int) -> float:
        return round(wall_ms * samples / max(total, 1), 2)

    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks.items():
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return {
        "samples": total,
        "prefill_ms": round(wall_ms, 1),
        "self": [[f, ms(n)] for f, n in own.most_common(top)],
        "inclusive": [[f, ms(n)] for f, n in inclusive.most_common(top + 20)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("samples", type=Path)
    parser.add_argument("--row", type=Path, required=True, help="bench_e2e.py's JSON row")
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args()
    walls = json.loads(ns.row.read_text())["host_profile_us"]["prefill_s_sampled"]
    row = summarize(read_stacks(ns.samples), 1e3 * statistics.median(walls))
    ns.out.write_text(json.dumps(row, indent=1) + "\n")
    print("HOST", ns.samples.name, row["samples"], "samples; prefill ms", row["prefill_ms"])
    for kind in ("self", "inclusive"):
        for frame, value in row[kind][:30]:
            print(f"{kind:9} {value:8.2f}  {frame[:150]}")


if __name__ == "__main__":
    main()
