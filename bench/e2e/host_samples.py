"""Where the host's time goes, from py-spy's samples of bench_e2e.py's sampled prefills.

    python3 bench/e2e/host_samples.py SAMPLES.txt --rate 250 --out ROW.json

SAMPLES.txt is `py-spy record --format raw --nolineno --idle --rate RATE` output: one line per
distinct stack, `frame;frame;...;leaf COUNT`. Only stacks through `timed_prefills` count; every
figure is ms per prefill (samples / rate / prefills). `self` is by leaf frame: where the thread
was, including waits (--idle keeps the samples of a thread blocked in a synchronize or a
launch). `inclusive` is by frame, each counted once per stack.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

try:
    from bench.e2e.bench_e2e import SAMPLED_PREFILLS
except ModuleNotFoundError:  # run as a script: bench_e2e.py sits beside this file
    from bench_e2e import SAMPLED_PREFILLS  # type: ignore[no-redef]

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


def summarize(stacks: Counter[tuple[str, ...]], rate: float, prefills: int, top: int = 40):
    def ms(samples: int) -> float:
        return round(1e3 * samples / rate / prefills, 2)

    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks.items():
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return {
        "ms_per_prefill": ms(sum(stacks.values())),
        "self": [[f, ms(n)] for f, n in own.most_common(top)],
        "inclusive": [[f, ms(n)] for f, n in inclusive.most_common(top + 20)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("samples", type=Path)
    parser.add_argument("--rate", type=float, required=True, help="py-spy's --rate, samples/s")
    parser.add_argument("--prefills", type=int, default=SAMPLED_PREFILLS)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args()
    row: dict[str, Any] = summarize(read_stacks(ns.samples), ns.rate, ns.prefills)
    ns.out.write_text(json.dumps(row, indent=1) + "\n")
    print("HOST", ns.samples.name, "ms per prefill", row["ms_per_prefill"])
    for kind in ("self", "inclusive"):
        for frame, value in row[kind][:30]:
            print(f"{kind:9} {value:8.2f}  {frame[:150]}")


if __name__ == "__main__":
    main()
