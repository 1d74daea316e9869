"""Rows of a device session: engine start-up split from vLLM's log, and the summary table.

    python3 -m bench.e2e.rows collect DIR OUT.jsonl --part P   # a part's rows, one file
    python3 -m bench.e2e.rows summary FILE.jsonl...            # the table of a session's rows

`startup_split` reads the lines vLLM 0.26 (and our plugin's warm-up) log while an engine starts;
with tensor parallelism every worker logs its own, and the slowest counts. The parts overlap:
`engine_init_s` (vLLM's "init engine (profile, create kv cache, warmup model)") holds the
compile, our LoRA warm-up and the CUDA-graph capture; `weights_load_s` comes before it.

`summary` prints one line per offline row (bench_e2e.py workload modes) with its decode speed
over the base row of the same model, machine and tensor-parallel size, TTFT p50/p90 and
start-up; one per server row (serve_e2e.py) with output tok/s and TTFT p50 over vLLM's own
server on the base model and with stock LoRA; and the check's agreement counts.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

STARTUP_PATTERNS = {
    "weights_load_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "dynamo_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "compile_s": r"torch\.compile took ([\d.]+) s in total",
    "lora_warm_up_s": r"loraplex MoE-LoRA kernels: LoRA warm-up of .* in ([\d.]+) s",
    "cuda_graphs_s": r"Graph capturing finished in ([\d.]+) secs",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}
COMPILE_CACHE_HIT = "Directly load the compiled graph"


def startup_split(log_text: str) -> dict[str, Any]:
    """Seconds per STARTUP_PATTERNS key found in `log_text` (the largest of repeated lines:
    one per worker), and whether torch.compile's graphs came from vLLM's cache."""
    split: dict[str, Any] = {}
    for key, pattern in STARTUP_PATTERNS.items():
        if found := [float(m) for m in re.findall(pattern, log_text)]:
            split[key] = max(found)
    split["compile_cache_hit"] = COMPILE_CACHE_HIT in log_text
    return split


def log_since(path: Path | None, offset: int) -> str:
    """`path`'s text from byte `offset` (where this process's part of a shared log begins)."""
    if path is None or not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def read_rows(paths: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def collect(folder: Path, part: str) -> list[dict[str, Any]]:
    """The rows a session part left in `folder`: each e2e_*.json (one object: a bench_e2e.py
    mode's row or the check's comparison) and each line of serve_e2e.py's e2e_serve_*.jsonl,
    marked with the part."""
    rows = [json.loads(path.read_text()) for path in sorted(folder.glob("e2e_*.json"))]
    rows += read_rows(sorted(folder.glob("e2e_serve_*.jsonl")))
    return [{**row, "part": part} for row in rows]


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return row.get("model"), row.get("machine"), row.get("tp", 1)


def offline_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per offline row: decode tok/s per request, its ratio over the base row of the same
    (model, machine, tp) (the latest such row), prefill ratio, TTFT and start-up."""
    offline = [r for r in rows if "otps_per_req_median" in r]
    base = {_key(r): r for r in offline if r["mode"] == "base"}
    table = []
    for r in offline:
        b = base.get(_key(r))
        table.append({
            "model": r.get("model"), "tp": r.get("tp", 1),
            "mode": mode_label(r),
            "otps": r["otps_per_req_median"],
            "vs_base": r["otps_per_req_median"] / b["otps_per_req_median"] if b else None,
            "prefill_vs_base": r["prefill_s_median"] / b["prefill_s_median"] if b else None,
            "ttft_p50_s": r.get("ttft_p50_s"), "ttft_p90_s": r.get("ttft_p90_s"),
            "startup_s": r.get("startup_s"), "startup": r.get("startup", {}),
        })  # fmt: skip
    return table


def mode_label(row: dict[str, Any]) -> str:
    """The row's mode, with what set it apart from the default run in brackets: a decode
    variant (rows of the variants' A/B, docs/kernels.md), vLLM's LoRA target modules."""
    marks = [str(row["variant"])] if row.get("variant") else []
    if row.get("lora_target_modules"):
        marks.append(f"targets={','.join(row['lora_target_modules'])}")
    return f"{row['mode']}[{';'.join(marks)}]" if marks else str(row["mode"])


def server_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server row with LoRA requests: output tok/s and TTFT p50 over vLLM's own server on
    the base model (`vllm-base`) and with stock LoRA (`vllm-stock`), same model and gpu."""
    served = [r for r in rows if "output_tok_s" in r]

    def find(server: str, model: Any, gpu: Any) -> dict[str, Any] | None:
        return next((r for r in served if r["server"] == server and r.get("model") == model
                     and r.get("gpu") == gpu), None)  # fmt: skip

    table = []
    for r in served:
        base = find("vllm-base", r.get("model"), r.get("gpu"))
        stock = find("vllm-stock", r.get("model"), r.get("gpu"))
        entry = {"model": r.get("model"), "server": r["server"], "requests": r["requests"],
                 "output_tok_s": r["output_tok_s"], "ttft_p50_s": r["ttft_p50_s"]}  # fmt: skip
        for name, ref in (("vs_vllm_base", base), ("vs_vllm_stock", stock)):
            entry[name] = r["output_tok_s"] / ref["output_tok_s"] if ref else None
        entry["ttft_vs_vllm_base"] = r["ttft_p50_s"] / base["ttft_p50_s"] if base else None
        table.append(entry)
    return table


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for t in offline_table(rows):
        split = " ".join(f"{k.removesuffix('_s')}={v:.0f}" for k, v in t["startup"].items()
                         if isinstance(v, float))  # fmt: skip
        lines.append(
            f"OFFLINE {t['model']} {t['mode']} tp{t['tp']}: {_fmt(t['otps'])} tok/s/req, "
            f"vs base {_fmt(t['vs_base'])}, prefill vs base {_fmt(t['prefill_vs_base'])}, "
            f"TTFT p50/p90 {_fmt(t['ttft_p50_s'])}/{_fmt(t['ttft_p90_s'])} s, start "
            f"{_fmt(t['startup_s'])} s ({split})"
        )
    for t in server_table(rows):
        lines.append(
            f"SERVER {t['model']} {t['server']} {t['requests']}: {_fmt(t['output_tok_s'])} "
            f"out tok/s, vs vllm-base {_fmt(t['vs_vllm_base'])}, vs vllm-stock "
            f"{_fmt(t['vs_vllm_stock'])}, TTFT p50 {_fmt(t['ttft_p50_s'])} s "
            f"(x{_fmt(t['ttft_vs_vllm_base'])} of vllm-base)"
        )
    for r in rows:
        if r.get("kind") == "check-compare":
            for label, entry in r["agreement"].items():
                lines.append(f"CHECK {label}: {entry['agree']}/{entry['requests']} agree "
                             f"({entry['against']}, {entry['which']}); flips "
                             f"{json.dumps(entry['differences'])}")  # fmt: skip
            timings = r.get("step_timing", {})
            for label, timing in timings.items():
                base = timings.get(base_label(label))
                ratio = timing["ms_per_step"] / base["ms_per_step"] if base else None
                lines.append(f"STEP {label}: {timing['ms_per_step']:.2f} ms/step "
                             f"(x{_fmt(ratio)} of {base_label(label)}), "
                             f"{timing['tokens_per_step']:.2f} tokens/step")  # fmt: skip
    return lines


def base_label(label: str) -> str:
    """The check run without LoRA that a run's step time compares with: same graph mode,
    tensor-parallel size and speculation."""
    kind = label.split("-")[1]  # check-<kind>[-graphs][-tpN][-ngram|-draft]
    return "check-base" + label.removeprefix(f"check-{kind}")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["collect", "summary"])
    parser.add_argument("files", type=Path, nargs="+", help="collect: DIR OUT; summary: rows")
    parser.add_argument("--part", default="", help="collect: the session part")
    ns = parser.parse_args()
    if ns.command == "collect":
        folder, out = ns.files
        rows = collect(folder, ns.part)
        out.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{len(rows)} rows in {out}")
        return
    for line in summary(read_rows([p for p in ns.files if p.exists()])):
        print(line)


if __name__ == "__main__":
    main()
