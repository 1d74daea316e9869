"""The e2e check beside a poisoned adapter (issue 45, finding 1): do the other requests keep
their greedy tokens when an adapter's weights are all NaN?

`bench_e2e.py poison-MODE` (MODE: stock | plugin | stock-graphs | plugin-graphs; all four and
`poison-compare` by `run_device.sh poison`): the e2e check's small real-weight Qwen3-MoE
(`bench_e2e.make_small_model`), its adapter 0 (`good`), and two copies of it, `twin` (the same
weights) and `nan` (every weight NaN); two GPU slots, so a copy and `good` share the batch.
One engine runs POISON_BATCHES three times, with `x` standing for a copy: `reference` (twin),
`poisoned` (nan), `after` (twin again, nan evicted from its slot or not). Greedy tokens,
ignore_eos; prefix caching off, so every sequence computes its prompts and a leak shows in the
step where it happens. A request not on `x` must give in `poisoned` and `after` the tokens it
gave in `reference` (batch compositions are the same, only x's values differ).

The batches cover steps with an adapter beside base-model requests, steps where only base
requests are left (x's requests stop first), and later batches without x: short prompts (CUDA
graphs in the graph modes), and long ones whose base-only prefill (4 x 640 tokens, 10,240
pairs) the plugin would run beside the GEMMs eagerly (`REGIMES.side_stream`,
kernels/dispatch.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

# Request: (adapter, max_tokens); adapter "good", "x" (nan or twin) or None (base model).
Request = tuple[str | None, int]
POISON_BATCHES: dict[str, list[Request]] = {
    "x beside good and base": [("good", 16), ("x", 16), (None, 16), (None, 16)],
    "x stops first, good and base go on": [("x", 4), (None, 16), ("good", 16), (None, 16)],
    "x stops first, base alone goes on": [("x", 4), (None, 16), (None, 16), (None, 16)],
    "later: base alone": [(None, 16)] * 4,
    "later: base alone, long prompts": [(None, 8)] * 4,
    "later: good beside base": [("good", 16), (None, 16), (None, 16), (None, 16)],
}
LONG_PROMPT, PROMPT = 640, 32
SEQUENCES = {"reference": "twin", "poisoned": "nan", "after": "twin"}
POISON_MODES = ("poison-stock", "poison-plugin", "poison-stock-graphs", "poison-plugin-graphs")


def copy_adapter(source: Path, target: Path, value: float | None) -> Path:
    """`source`'s adapter files at `target`, every weight set to `value` (None: as they are)."""
    import torch
    from safetensors.torch import load_file, save_file

    if not (target / "adapter_model.safetensors").exists():
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / "adapter_config.json", target / "adapter_config.json")
        tensors = load_file(source / "adapter_model.safetensors")
        if value is not None:
            tensors = {name: torch.full_like(t, value) for name, t in tensors.items()}
        save_file(tensors, target / "adapter_model.safetensors")
    return target


def _prompts(rnd: random.Random, batch: str) -> list[Any]:
    length = LONG_PROMPT if "long" in batch else PROMPT
    return [
        {"prompt_token_ids": [rnd.randrange(10, 4000) for _ in range(length)]}
        for _ in POISON_BATCHES[batch]
    ]


def run_poison(ns: argparse.Namespace) -> dict:
    """Greedy tokens of every request of every sequence (see the module docstring)."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from bench.e2e.bench_e2e import _lead, make_small_model
    from bench.e2e.shapes import RANK, SMALL_CHECK, make_adapter

    model = Path("/tmp/e2e_small")
    make_small_model(model)
    good = Path("/tmp/e2e_small_lora0")
    make_adapter(good, SMALL_CHECK, seed=10, scale=0.05)  # the check's adapter 0
    adapters = {
        "good": good,
        "twin": copy_adapter(good, Path("/tmp/e2e_small_lora0_twin"), None),
        "nan": copy_adapter(good, Path("/tmp/e2e_small_lora0_nan"), float("nan")),
    }
    requests = {
        name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())
    }
    graphs = ns.mode.endswith("graphs")
    llm = LLM(model=str(model), skip_tokenizer_init=True, max_model_len=1024, enable_lora=True,
              max_loras=2, max_cpu_loras=3, max_lora_rank=RANK, gpu_memory_utilization=0.3,
              enforce_eager=not graphs, enable_prefix_caching=False)  # fmt: skip
    rnd = random.Random(3)
    prompts = {batch: _prompts(rnd, batch) for batch in POISON_BATCHES}
    result: dict[str, Any] = {}
    for sequence, x in SEQUENCES.items():
        rows = []
        for batch, batch_requests in POISON_BATCHES.items():
            params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True,
                                     detokenize=False) for _, n in batch_requests]  # fmt: skip
            # vLLM takes None in the list for a request without adapter; its hint says otherwise.
            lrs: list[Any] = [
                None if a is None else requests[x if a == "x" else a] for a, _ in batch_requests
            ]
            outs = llm.generate(prompts[batch], params, lora_request=lrs, use_tqdm=False)
            for (adapter, _), out in zip(batch_requests, outs, strict=True):
                done = out.outputs[0]
                margins = [_lead(step) for step in done.logprobs or []]
                rows.append({"batch": batch, "adapter": adapter, "tokens": list(done.token_ids),
                             "margins": margins})  # fmt: skip
        result[sequence] = rows
    return {"sequences": result, "verdict": verdict(result)}


def verdict(sequences: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per sequence against `reference`: the requests not on x that kept their tokens, and for
    each that did not, its batch, adapter, first different position and the reference's margin
    there (an exact tie's flip tells itself apart from a leak, which brings NaN margins);
    and whether x's own requests came out NaN in `poisoned` (the poison took)."""
    reference = sequences["reference"]
    out: dict[str, Any] = {}
    for sequence in ("poisoned", "after"):
        rows = sequences[sequence]
        kept, differences = 0, []
        for want, got in zip(reference, rows, strict=True):
            if want["adapter"] == "x":
                continue
            at = next((i for i, (a, b) in enumerate(zip(want["tokens"], got["tokens"],
                                                       strict=True)) if a != b), None)  # fmt: skip
            if at is None:
                kept += 1
                continue
            nan_margins = sum(math.isnan(m) for m in got["margins"])
            differences.append({"batch": got["batch"], "adapter": got["adapter"], "position": at,
                                "reference_margin": want["margins"][at],
                                "nan_margins": nan_margins})  # fmt: skip
        others = sum(row["adapter"] != "x" for row in rows)
        out[sequence] = {"kept": kept, "others": others, "differences": differences}
    poisoned_x = [row for row in sequences["poisoned"] if row["adapter"] == "x"]
    out["poison_took"] = all(any(math.isnan(m) for m in row["margins"]) for row in poisoned_x)
    return out


def compare(out: Path) -> dict[str, Any]:
    """Every poison mode's verdict that ran, and its reference tokens against stock eager's
    reference (the plugin's numbers against vLLM's, clean)."""
    rows = {m: json.loads((out / f"e2e_{m}.json").read_text()) for m in POISON_MODES
            if (out / f"e2e_{m}.json").exists()}  # fmt: skip
    result: dict[str, Any] = {}
    stock = rows.get("poison-stock")
    for mode, row in rows.items():
        entry: dict[str, Any] = dict(row["verdict"])
        if stock is not None and mode != "poison-stock":
            pairs = zip(stock["sequences"]["reference"], row["sequences"]["reference"], strict=True)
            entry["reference_agrees_with_stock"] = sum(a["tokens"] == b["tokens"] for a, b in pairs)
        result[mode] = entry
    return result
