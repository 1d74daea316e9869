"""Tensor parallelism through `loraplex serve` (issue 41): TP=2 serves base and adapters with the
MoE-LoRA plugin on, and its greedy tokens equal TP=1's.

    PYTHONPATH=/tmp/site:. python3 -m bench.e2e.serve_tp --commit SHA --out DIR --install /tmp/site
    (bench/e2e/run_device.sh COMMIT serve-tp, on the 2-GPU kind)

For each TP size it starts `loraplex serve` with `engine.vllm_args.tensor_parallel_size` on the
small Qwen3-MoE of bench_e2e.py's check (real random weights, placeholder tokenizer) and its two
adapters (attention and every expert), and sends bench_e2e.py's three check batches at once as
greedy token-id completions (16 tokens, logprobs 2): both adapters, both beside base requests,
one beside them. It prints, per request, whether TP=2's tokens equal TP=1's, and where they do
not, the position and TP=1's margin there (top-1 over top-2 logprob), so that a flip between
near-tied tokens tells itself apart from a wrong result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx

from bench.common import stamp
from bench.e2e.bench_e2e import (
    CHECK_BATCHES,
    RANK,
    install_entry_point,
    make_small_model,
)
from bench.e2e.serve_e2e import write_placeholder_tokenizer
from bench.e2e.shapes import SMALL_CHECK, make_adapter
from bench.loadgen.server import ServerProcess

START_TIMEOUT_S = 480.0


def prepare(root: Path) -> tuple[Path, Path]:
    """The small Qwen3-MoE with a tokenizer loraplex can render with, and its two adapters."""
    model = root / "small-qwen3-moe"
    make_small_model(model)
    if not (model / "tokenizer.json").exists():
        config = json.loads((model / "config.json").read_text())
        write_placeholder_tokenizer(model, config["vocab_size"], config.get("eos_token_id") or 2)
    adapters = root / "adapters"
    for i in range(2):
        make_adapter(adapters / f"a{i}", SMALL_CHECK, seed=10 + i, scale=0.05)
    return model, adapters


async def greedy(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 2}
    async with httpx.AsyncClient(timeout=300) as http:
        reply = await http.post(url + "/v1/completions", json=body)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    logprobs = choice["logprobs"]
    tops = [sorted(step.values(), reverse=True) for step in logprobs["top_logprobs"]]
    margins = [top[0] - top[1] if len(top) > 1 else float("inf") for top in tops]
    return {"tokens": logprobs["tokens"], "margins": margins}


def run(tp: int, model: Path, adapters: Path, out: Path) -> list[dict[str, Any]]:
    """Each check batch's greedy completions (sent at once) from a server at this TP size."""
    server = ServerProcess(
        env={
            "LORAPLEX_CACHE_DIR": str(out / f"cache_tp{tp}"),
            "LORAPLEX_ENGINE__MAX_LORA_RANK": str(RANK),
            "LORAPLEX_ENGINE__MAX_LORAS": "2",
            "LORAPLEX_ENGINE__MAX_MODEL_LEN": "512",
            "LORAPLEX_ENGINE__GPU_MEMORY_UTILIZATION": "0.3",
            "LORAPLEX_ENGINE__VLLM_ARGS": json.dumps({"tensor_parallel_size": tp}),
        },
        args=["--model", str(model), "--adapters-dir", str(adapters)],
        log_path=out / f"serve_tp{tp}.log",
    ).start(timeout=START_TIMEOUT_S)
    rnd = random.Random(1)
    prompts = [[rnd.randrange(10, 4000) for _ in range(32)] for _ in range(4)]
    results: list[dict[str, Any]] = []
    try:
        for batch in CHECK_BATCHES.values():
            names = [model.name if a is None else f"a{a}" for a in batch]

            async def send(names: list[str] = names) -> list[dict[str, Any]]:
                calls = (greedy(server.base_url, n, p) for n, p in zip(names, prompts, strict=True))
                return list(await asyncio.gather(*calls))

            results += asyncio.run(send())
    finally:
        server.stop(timeout=60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--root", type=Path, default=Path("/tmp/e2e_tp"))
    parser.add_argument("--install", type=Path, help="write the plugin's dist-info here first")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.install:
        install_entry_point(ns.install)
    model, adapters = prepare(ns.root)
    one, two = (run(tp, model, adapters, ns.out) for tp in (1, 2))
    requests = [a for batch in CHECK_BATCHES.values() for a in batch]
    differences = []
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        pairs = enumerate(zip(a["tokens"], b["tokens"], strict=True))
        at = next((j for j, (x, y) in pairs if x != y), None)
        if at is not None:
            differences.append({"request": i, "adapter": requests[i], "position": at,
                                "tp1_margin": a["margins"][at]})  # fmt: skip
    import torch

    row = {**stamp(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "commit": ns.commit, "requests": len(one), "agree": len(one) - len(differences),
           "differences": differences, "adapters": requests,
           "tp1": [r["tokens"] for r in one], "tp2": [r["tokens"] for r in two]}  # fmt: skip
    summary = {k: row[k] for k in ("requests", "agree", "differences")}
    print("CHECK tp2 vs tp1", json.dumps(summary), flush=True)
    (ns.out / "e2e_serve_tp.json").write_text(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
