"""What the poisoned-adapter defences cost on decode: the finite guard and the isolation patches.

One engine (the server's settings, loraplex's vLLM plugin loaded as the server loads it), one
batch of concurrent greedy requests per measurement: half base model, the rest round robin over
the demo adapters, so every step mixes tokens with and without an adapter; fixed prompt and
output lengths, ignore_eos, random prompts (no prefix-cache hits). vLLM's own scheduler, so every
prompt is prefilled in the first step. Decode throughput = output tokens after each request's
first / (last end - last first token). Three variants, interleaved in each repetition:

- `guarded`:   through `EngineClient.generate` (logprob 0 asked for, every output checked);
- `unguarded`: the same requests straight to vLLM's AsyncLLM with the client's params;
- `unpatched`: as `unguarded`, with the masked LoRA ops and the finite KV writes swapped back to
  vLLM's own for the repetition, in the worker, through a vLLM worker extension (`PatchSwitch`).
  (The third patch, zeroing a freed slot, runs only when an adapter leaves its slot.)

Then, with the engine shut down, what the guard adds inside the engine alone: vLLM's own
`Sampler.compute_logprobs` and `gather_logprobs` (k=0, the sampled token's) on a step's logits
(one fp32 row per request, the model's vocabulary; one thread), against the `unguarded` decode
step time of the same run (requests / tok/s). That number moves far less with the machine's load.

Prints a table with each ratio (of the medians, and the median of each repetition's own ratio,
which a load that drifts between repetitions moves less) and appends rows (machine, commit,
config) to bench/results/isolation_cost.jsonl.

    python -m bench.isolation_cost [--requests 16] [--prompt-tokens 64] [--output-tokens 64]
                                   [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import os
import random
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import append_rows, stamp

# Where the isolation patches replace vLLM's functions: (module, attribute).
PATCHED = [
    *((m, op) for m in ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.ops.torch_ops",
                        "vllm.lora.punica_wrapper.punica_cpu")
      for op in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")),
    ("vllm._custom_ops", "cpu_attn_reshape_and_cache"),
]  # fmt: skip
VARIANTS = ("guarded", "unguarded", "unpatched")


class PatchSwitch:
    """vLLM worker extension (mixed into the worker): `set_isolation_patches(on)` swaps the
    patched functions for vLLM's own (`__wrapped__`) and back."""

    def set_isolation_patches(self, on: bool) -> None:
        for module_name, name in PATCHED:
            module = importlib.import_module(module_name)
            current = getattr(module, name)
            stash = f"_bench_patched_{name}"
            if on and hasattr(module, stash):
                setattr(module, name, getattr(module, stash))
            elif not on and hasattr(current, "__wrapped__"):
                setattr(module, stash, current)
                setattr(module, name, current.__wrapped__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    return p.parse_args(argv)


def decode_tok_s(firsts: list[float], ends: list[float], tokens: int) -> float:
    """Output tokens after each request's first, over the span when every request decodes."""
    return (tokens - len(firsts)) / (max(ends) - max(firsts))


async def timed(stream: AsyncIterator[Any]) -> tuple[float, float, int]:
    """(first token time, end time, output tokens) of one request's DELTA stream."""
    first, tokens = 0.0, 0
    async for output in stream:
        tokens += sum(len(o.token_ids) for o in output.outputs)
        if not first and tokens:
            first = time.perf_counter()
    return first, time.perf_counter(), tokens


async def measure(args: argparse.Namespace) -> tuple[dict[str, list[float]], int]:
    """Decode tok/s per repetition of each variant, and the model's vocabulary size."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from loraplex.adapters_registry.base import ServableAdapter
    from loraplex.server.demo.adapters import DEMO_ADAPTERS, ensure_demo_adapters
    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.engine.builder import (
        engine_args,
        export_engine_environment,
        vllm_namespace,
    )
    from loraplex.server.engine.client import EngineClient
    from loraplex.server.settings import EngineSettings, default_cache_dir

    model_dir = ensure_demo_model(default_cache_dir())
    demo = ensure_demo_adapters(model_dir, default_cache_dir())
    adapters = [ServableAdapter(s.name, "v1", i + 1, demo / s.name, s.rank)
                for i, s in enumerate(DEMO_ADAPTERS)]  # fmt: skip
    switch = f"{PatchSwitch.__module__}.{PatchSwitch.__qualname__}"
    settings = EngineSettings.model_validate(
        {"paced_prefill_tokens": None, "vllm_args": {"worker_extension_cls": switch}}
    )
    # Built as EngineClient.start builds it, kept at hand for the unguarded requests.
    export_engine_environment(settings)
    engine = AsyncLLM.from_engine_args(
        engine_args(settings, vllm_namespace(settings, model_dir, "bench"))
    )
    tokenizer = engine.get_tokenizer()
    if inspect.isawaitable(tokenizer):  # vLLM < 0.30 made this a coroutine
        tokenizer = await tokenizer
    client = EngineClient(engine, tokenizer, settings.max_model_len)
    rng = random.Random(0)
    params = SamplingParams(
        temperature=0,
        max_tokens=args.output_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )  # as the gateway asks
    which = [None if i % 2 == 0 else adapters[(i // 2) % len(adapters)]
             for i in range(args.requests)]  # fmt: skip

    async def batch(variant: str) -> float:
        await engine.collective_rpc("set_isolation_patches", args=(variant != "unpatched",))
        streams = []
        for adapter in which:
            prompt = [rng.randrange(100, len(tokenizer)) for _ in range(args.prompt_tokens)]
            rid = os.urandom(8).hex()
            if variant == "guarded":
                streams.append(client.generate(prompt, params, adapter, rid))
            else:
                lora = client.lora_request(adapter) if adapter else None
                streams.append(engine.generate(
                    {"prompt_token_ids": prompt}, params, rid, lora_request=lora))  # fmt: skip
        results = await asyncio.gather(*(timed(s) for s in streams))
        firsts, ends, tokens = zip(*results, strict=True)
        return decode_tok_s(list(firsts), list(ends), sum(tokens))

    try:
        await batch("unguarded")  # warm-up: adapters loaded, first-step costs paid
        measured: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.reps):
            for variant in VARIANTS:
                measured[variant].append(await batch(variant))
        return measured, engine.model_config.get_vocab_size()
    finally:
        engine.shutdown()


def logprob_step_ms(rows: int, vocab: int, reps: int = 200) -> float:
    """Median ms of the work vLLM's sampler does for a step's sampled-token logprobs (what the
    guard asks for), on `rows` fp32 rows of `vocab` logits, on one thread of this process: at
    the torch default (2 threads on the 2-core machine) beside other jobs a median took 56 ms
    against 0.75 ms on one, the threads waiting on each other."""
    import torch
    from vllm.v1.sample.sampler import Sampler

    torch.set_num_threads(1)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    sampled = logits.argmax(dim=-1)
    times = []
    for _ in range(reps + 10):  # the first 10 warm up
        start = time.perf_counter()
        Sampler.gather_logprobs(Sampler.compute_logprobs(logits), 0, token_ids=sampled)
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    measured, vocab = asyncio.run(measure(args))
    config = {k: getattr(args, k) for k in ("requests", "prompt_tokens", "output_tokens", "reps")}
    base = {**stamp(), "bench": "isolation_cost", "config": config}
    rows: list[dict[str, Any]] = [
        {**base, "variant": v, "decode_tok_s": runs, "median": statistics.median(runs)}
        for v, runs in measured.items()
    ]
    median = {row["variant"]: row["median"] for row in rows}
    table = Table(title=f"decode tok/s, {args.requests} requests (median of {args.reps})")
    for column in ("defence", "with", "without", "with / without", "paired, median"):
        table.add_column(column)
    for name, on, off in (("finite guard", "guarded", "unguarded"),
                          ("isolation patches", "unguarded", "unpatched")):  # fmt: skip
        ratio = median[on] / median[off]
        # Each repetition's own ratio: its variants ran back to back, under the same load.
        paired = statistics.median(a / b for a, b in zip(measured[on], measured[off], strict=True))
        table.add_row(name, f"{median[on]:.1f}", f"{median[off]:.1f}", f"{ratio:.3f}",
                      f"{paired:.3f}")  # fmt: skip
        rows.append({**base, "compare": name, "ratio": ratio, "paired_ratio": paired})
    Console().print(table)
    work_ms = logprob_step_ms(args.requests, vocab)
    step_ms = args.requests / median["unguarded"] * 1e3  # one token per request a step
    work = Table(title=f"the guard's sampler work per decode step ({args.requests} x {vocab})")
    for column in ("logprob work, ms", "unguarded step, ms", "work / step"):
        work.add_column(column)
    work.add_row(f"{work_ms:.2f}", f"{step_ms:.1f}", f"{work_ms / step_ms:.4f}")
    Console().print(work)
    rows.append({**base, "compare": "logprob work per step", "vocab": vocab,
                 "work_ms": work_ms, "step_ms": step_ms, "ratio": work_ms / step_ms})  # fmt: skip
    print(f"rows appended to {append_rows('isolation_cost', rows)}")


if __name__ == "__main__":
    main()
