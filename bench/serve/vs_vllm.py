"""loraplex's gateway vs vLLM's own OpenAI server, same model and engine settings, one run.

Runs vLLM's benchmark client (`vllm.benchmarks.serve`) against both servers, alternating
loraplex, vLLM, loraplex, vLLM, ... (one server up at a time) so drift on a noisy machine hits
both alike, and prints the
ratio of output throughput and the difference of median TTFT. Both servers enable LoRA with the
same limits and the requests name the base model, so the difference is the gateway's cost.

    python -m bench.serve.vs_vllm --repeats 3            # writes bench/results/serve_vs_vllm.jsonl
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import append_rows, stamp
from bench.loadgen.server import ServerProcess

ENGINE_FLAGS = {
    "max_model_len": 2048,
    "max_loras": 4,
    "max_cpu_loras": 8,
    "max_lora_rank": 16,
    # Named for both servers: loraplex would pick it on AVX2 CPUs, vLLM would pick bf16.
    "dtype": "float32",
}


def vllm_server(model_dir: Path, name: str) -> ServerProcess:
    """vLLM's own OpenAI server, started like ServerProcess starts loraplex."""
    server = ServerProcess(env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    server.command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(server.port),
        "--enable-lora",
        *(f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()),
    ]
    server.ready_path = "/health"
    return server


def run_client(
    server: ServerProcess, name: str, model_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    client_args = parser.parse_args(
        [
            "--backend",
            "openai-chat",
            "--base-url",
            server.base_url,
            "--endpoint",
            "/v1/chat/completions",
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--max-concurrency",
            str(args.concurrency),
            "--num-prompts",
            str(args.num_prompts),
            "--model",
            name,
            "--tokenizer",
            str(model_dir),
            "--ignore-eos",
            "--disable-tqdm",
            "--seed",
            str(args.seed),
        ]
    )
    result = serve.main(client_args)
    return {
        "output_throughput": result["output_throughput"],
        "median_ttft_ms": result["median_ttft_ms"],
        "median_tpot_ms": result["median_tpot_ms"],
        "completed": result["completed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from loraplex.server.demo.model import DEMO_MODEL_NAME, ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    model_dir = ensure_demo_model(default_cache_dir())
    servers = {
        "loraplex": lambda: ServerProcess(
            env={f"LORAPLEX_ENGINE__{k.upper()}": str(v) for k, v in ENGINE_FLAGS.items()}
        ),
        "vllm": lambda: vllm_server(model_dir, DEMO_MODEL_NAME),
    }
    runs: dict[str, list[dict[str, Any]]] = {"loraplex": [], "vllm": []}
    # One server up at a time: an idle vLLM CPU worker still polls and would steal a core
    # (seen: 30% of a core while idle), so running both at once measures neither.
    for _ in range(args.repeats):
        for label, make in servers.items():
            server = make().start()
            try:
                runs[label].append(run_client(server, DEMO_MODEL_NAME, model_dir, args))
            finally:
                server.stop()

    def median(label: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[label])

    ratio = median("loraplex", "output_throughput") / median("vllm", "output_throughput")
    ttft_delta = median("loraplex", "median_ttft_ms") - median("vllm", "median_ttft_ms")
    print(f"\n{'server':<10}{'out tok/s (median)':>20}{'TTFT p50 ms':>14}{'TPOT p50 ms':>14}")
    for label in runs:
        print(
            f"{label:<10}{median(label, 'output_throughput'):>20.1f}"
            f"{median(label, 'median_ttft_ms'):>14.1f}{median(label, 'median_tpot_ms'):>14.2f}"
        )
    print(f"\nthroughput ratio loraplex/vLLM: {ratio:.3f}   (target >= 0.97)")
    print(f"median TTFT difference: {ttft_delta:+.1f} ms   (target <= +5 ms)")
    row = {
        **stamp(),
        "bench": "serve_vs_vllm",
        "config": vars(args) | ENGINE_FLAGS,
        "runs": runs,
        "throughput_ratio": ratio,
        "ttft_delta_ms": ttft_delta,
    }
    print("wrote", append_rows("serve_vs_vllm", [row]))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
