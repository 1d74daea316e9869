"""Per-tenant summary of a load-generator run: a printed table, JSON rows and a PNG chart."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.common import stamp
from bench.loadgen.client import Sample
from bench.loadgen.workload import Workload

QUANTILES = (50, 90, 99)


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in QUANTILES}
    arr = np.asarray(values)
    return {f"p{q}": float(np.percentile(arr, q)) for q in QUANTILES}


def summarize(workload: Workload, samples: list[Sample], wall_s: float) -> dict[str, Any]:
    tenants: dict[str, Any] = {}
    for tenant in workload.tenants:
        mine = [s for s in samples if s.tenant == tenant.name]
        ok = [s for s in mine if s.ok]
        good = [
            s
            for s in ok
            if s.ttft_s is not None
            and s.ttft_s <= workload.slo.ttft_s
            and (s.tpot_s is None or s.tpot_s <= workload.slo.tpot_s)
        ]
        tenants[tenant.name] = {
            "requests": len(mine),
            "ok": len(ok),
            "errors": dict(Counter(str(s.status) for s in mine if not s.ok)),
            "ttft_s": _pcts([s.ttft_s for s in ok if s.ttft_s is not None]),
            "tpot_s": _pcts([s.tpot_s for s in ok if s.tpot_s is not None]),
            "itl_s": _pcts([g for s in ok for g in s.inter_token_latencies()]),
            "otps": _pcts([v for s in ok if (v := s.output_tokens_per_s) is not None]),
            "e2e_s": _pcts([s.e2e_s for s in ok if s.e2e_s is not None]),
            "output_tokens_per_s": sum(s.completion_tokens for s in ok) / wall_s,
            "goodput_rps": len(good) / wall_s,
            "offered": {"rate": tenant.rate, "concurrency": tenant.concurrency},
        }
    return {
        **stamp(),
        "wall_s": wall_s,
        "slo": workload.slo.model_dump(),
        "workload": workload.model_dump(exclude={"tenants": {"__all__": {"api_key"}}}),
        "tenants": tenants,
    }


def print_table(summary: dict[str, Any], console: Console | None = None) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.1f}"

    table = Table(title=f"loadgen @ {summary['commit']} ({summary['wall_s']:.1f} s)")
    for col in ("tenant", "ok/req", "TTFT p50/p90/p99 ms", "TPOT p50 ms", "ITL p90 ms"):
        table.add_column(col)
    for col in ("OTPS/req p50", "out tok/s", "goodput req/s"):
        table.add_column(col, justify="right")
    for name, t in summary["tenants"].items():
        ttft = "/".join(ms(t["ttft_s"][f"p{q}"]) for q in QUANTILES)
        otps = t["otps"]["p50"]
        table.add_row(
            name,
            f"{t['ok']}/{t['requests']}",
            ttft,
            ms(t["tpot_s"]["p50"]),
            ms(t["itl_s"]["p90"]),
            "-" if otps is None else f"{otps:.1f}",
            f"{t['output_tokens_per_s']:.1f}",
            f"{t['goodput_rps']:.2f}",
        )
    (console or Console(width=160)).print(table)


def write_outputs(summary: dict[str, Any], samples: list[Sample], out: Path) -> tuple[Path, Path]:
    """`out.json` (summary) and `out.png` (TTFT and per-request OTPS distributions per tenant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    # Appended, not `with_suffix`: a name with dots in it (rate0.25) would lose its tail.
    json_path, png_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".png")
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    fig, (ax_ttft, ax_otps) = plt.subplots(1, 2, figsize=(11, 4))
    for name in summary["tenants"]:
        ok = [s for s in samples if s.tenant == name and s.ok]
        for ax, values in (
            (ax_ttft, sorted(s.ttft_s * 1000 for s in ok if s.ttft_s is not None)),
            (ax_otps, sorted(v for s in ok if (v := s.output_tokens_per_s) is not None)),
        ):
            if values:
                ax.plot(values, np.linspace(0, 1, len(values)), label=name)
    ax_ttft.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF per tenant")
    ax_otps.set(xlabel="output tokens/s per request", title="Per-request OTPS CDF per tenant")
    for ax in (ax_ttft, ax_otps):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return json_path, png_path
