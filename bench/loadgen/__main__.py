"""`python -m bench.loadgen WORKLOAD.yml [--out bench/results/NAME]`: run a workload, report it."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from bench.loadgen.client import run_workload
from bench.loadgen.report import print_table, summarize, write_outputs
from bench.loadgen.workload import Workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__)
    parser.add_argument("workload", type=Path, help="workload YAML file")
    parser.add_argument("--out", type=Path, default=Path("bench/results/tmp/loadgen"))
    parser.add_argument("--base-url", help="overrides the workload's base_url")
    args = parser.parse_args(argv)
    workload = Workload.from_file(args.workload)
    if args.base_url:
        workload.base_url = args.base_url
    samples, wall_s = asyncio.run(run_workload(workload))
    summary = summarize(workload, samples, wall_s)
    print_table(summary)
    json_path, png_path = write_outputs(summary, samples, args.out)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
