"""Decode by the batch's adapters, vLLM's CUDA graphs captured per adapter count or for any count.

    PYTHONPATH=/tmp/site:. python3 bench/e2e/bench_adapter_count.py MODE --commit SHA --out DIR \
        [--workload one | one-beside-base | round-robin]
    MODE: graphs-any-count | graphs-per-count | compare

With the plugin in, the MoE-LoRA routing form of a decode batch is the naive one up to a pair per
(adapter slot, expert) over all slots, which reads a (slot, expert) once per pair: with one
adapter on every token, 8 times over at Qwen3-30B-A3B's 128 tokens. Where vLLM captures a graph
per count of active adapters (`specialize_active_lora`, loraplex's engine setting of that name),
the plugin knows the count and sorts such batches (`REGIMES.naive`, kernels/dispatch.py), and
vLLM's own kernels launch for that many adapters.

Workload: `bench_e2e`'s Qwen3-30B-A3B-shaped model with dummy weights (`--layers` of them) and
its rank-32 adapter, the plugin on, REQUESTS requests at once of PROMPT random prompt tokens and
OUTPUT output tokens: all on that adapter (`one`), every other one on it and the rest on the base
model (`one-beside-base`), or round robin over 8 adapters (`round-robin`: the same weights
under 8 ids, 8 slots). Per repetition: the wall time of the whole generate and its output tokens
per second; each mode in its own process. `compare` prints both modes of the workload side by
side with their ratio and writes the rows to DIR/e2e_adapter_count.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.e2e.bench_e2e import install_entry_point
from bench.e2e.shapes import dims, make_adapter, make_model
from loraplex.kernels.vllm.plugin import ENV_SWITCH, compile_cache_config

REQUESTS, PROMPT, OUTPUT = 128, 64, 256
MODES = {"graphs-any-count": False, "graphs-per-count": True}  # mode -> specialize_active_lora
WORKLOADS = ("one", "one-beside-base", "round-robin")
SLOTS = 8


def run(ns: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model, adapter = Path("/tmp/e2e_model"), Path("/tmp/e2e_lora")
    cfg = make_model(model, "qwen3-30b-a3b", ns.layers)
    make_adapter(adapter, dims(cfg), seed=0)
    start = time.time()
    llm = LLM(
        model=str(model), load_format="dummy", skip_tokenizer_init=True, max_model_len=1024,
        gpu_memory_utilization=0.88, max_num_seqs=REQUESTS, enable_lora=True, max_loras=SLOTS,
        max_lora_rank=32, max_cpu_loras=SLOTS, additional_config=compile_cache_config(True),
        specialize_active_lora=MODES[ns.mode],
    )  # fmt: skip
    startup = time.time() - start
    rnd = random.Random(0)
    loras = [LoRARequest(f"ad{i}", i + 1, str(adapter)) for i in range(SLOTS)]
    # Per request: its adapter, None for the base model. vLLM takes None in the list; its hint
    # says otherwise.
    by_workload: dict[str, list[Any]] = {
        "one": [loras[0]] * REQUESTS,
        "one-beside-base": [loras[0] if i % 2 == 0 else None for i in range(REQUESTS)],
        "round-robin": [loras[i % SLOTS] for i in range(REQUESTS)],
    }
    requests = by_workload[ns.workload]

    def prompts() -> list[Any]:
        return [{"prompt_token_ids": [rnd.randrange(1000, 100000) for _ in range(PROMPT)]}
                for _ in range(REQUESTS)]  # fmt: skip

    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True, detokenize=False)
    # Loads the workload's adapters.
    llm.generate(prompts()[:SLOTS], params, lora_request=requests[:SLOTS], use_tqdm=False)
    reps = []
    for _ in range(ns.reps):
        batch = prompts()
        t = time.time()
        outs = llm.generate(batch, params, lora_request=requests, use_tqdm=False)
        wall = time.time() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        reps.append({"wall_s": wall, "out_tokens": tokens, "tokens_per_s": tokens / wall})
    return {"startup_s": startup, "reps": reps,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in reps)}  # fmt: skip


def compare(out: Path, workload: str) -> list[dict]:
    rows = [json.loads((out / f"e2e_{workload}_{mode}.json").read_text()) for mode in MODES]
    any_count, per_count = (r["tokens_per_s_median"] for r in rows)
    print(f"workload {workload}")
    print(f"{'mode':18s} {'tok/s':>9s} {'startup s':>10s}")
    for r in rows:
        print(f"{r['mode']:18s} {r['tokens_per_s_median']:9.1f} {r['startup_s']:10.1f}")
    print(f"per count / any count: x{per_count / any_count:.3f}")
    (out / f"e2e_adapter_count_{workload}.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=[*MODES, "compare"])
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workload", choices=WORKLOADS, default="one")
    parser.add_argument("--install", type=Path, help="write the plugin's dist-info here first")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.mode == "compare":
        compare(ns.out, ns.workload)
        return
    if ns.install:
        print("plugin entry point in", install_entry_point(ns.install), flush=True)
    os.environ[ENV_SWITCH] = "1"  # vLLM's engine processes inherit it (kernels/vllm/plugin.py)
    import torch

    row = {"mode": ns.mode, "workload": ns.workload, "machine": torch.cuda.get_device_name(),
           "commit": ns.commit, "layers": ns.layers, "requests": REQUESTS, "prompt_tokens": PROMPT,
           "output_tokens": OUTPUT, **run(ns)}  # fmt: skip
    (ns.out / f"e2e_{ns.workload}_{ns.mode}.json").write_text(json.dumps(row, indent=1) + "\n")
    print("RESULT", json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
