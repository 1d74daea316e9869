"""Where a GPU test run's time went, from pytest-reportlog's log (`--report-log FILE`), which
keeps each test as it ends: so a run cut by its time limit still says what finished, what failed
and which tests were slowest.

    python3 -m bench.kernels.test_times FILE [--top N]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path


def summarize(lines: list[str], top: int) -> list[str]:
    """Outcome counts per test (a test fails if any phase failed) and the `top` slowest tests,
    their setup, call and teardown summed. A line that is not JSON (the last one of a run cut
    while writing it) is skipped."""
    seconds: dict[str, float] = defaultdict(float)
    outcome: dict[str, str] = {}
    for line in lines:
        try:
            report = json.loads(line)
        except json.JSONDecodeError:
            continue
        if report.get("$report_type") != "TestReport":
            continue
        test = report["nodeid"]
        seconds[test] += report["duration"]
        if report["outcome"] != "passed" or report["when"] == "call":
            outcome[test] = report["outcome"] if outcome.get(test) != "failed" else "failed"
    counts = Counter(outcome.values())
    out = [", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "no test ended"]
    out += [f"{s:8.1f} s  {t}" for t, s in sorted(seconds.items(), key=lambda x: -x[1])[:top]]
    out += [f"FAILED {t}" for t, o in outcome.items() if o == "failed"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=20)
    ns = parser.parse_args()
    text = ns.log.read_text() if ns.log.is_file() else ""
    print("\n".join(summarize(text.splitlines(), ns.top)))


if __name__ == "__main__":
    main()
