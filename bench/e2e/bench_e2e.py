"""End to end on the device: base model, stock vLLM with LoRA, vLLM with the loraplex plugin.

    PYTHONPATH=/tmp/site:. python3 bench/e2e/bench_e2e.py MODE --commit SHA --out DIR
        [--model qwen3-30b-a3b|gpt-oss-20b] [--tp N] [--spec ngram|draft] [--log FILE]
        [--lora-targets MODULE ...]
    MODE: base | stock | plugin | check-stock | check-plugin | check-plugin-graphs
          | check-stock-graphs | check-base | check-base-graphs | compare
          | poison-stock | poison-plugin | poison-stock-graphs | poison-plugin-graphs
          | poison-compare   (run_device.sh poison runs the four: poison_check.py)
    bench/e2e/run_session.sh runs issue 43's set in parts, two GPUs side by side or one lane on one.

base/stock/plugin: the workload of issue 6 on a model shape with dummy weights (`--model`,
bench/e2e/shapes.py: Qwen3-30B-A3B, 48 layers, 128 experts top-8; GPT-OSS-20B, 24 layers, 32
experts top-4, bf16; `--layers` for fewer): 16 concurrent requests of 1600 prompt and 600 output
tokens, 8 rank-32 adapters on attention and all experts, round robin, CUDA graphs on. Per
repetition (default 3, fresh prompts each, no prefix-cache hits): the prefill time of the 16
prompts (max_tokens=1), then the 600-token run streamed (`stream_generate`): the output tokens/s
per request, (600 - 1) / (total - prefill), the proxy of ../shared/gpu/example_bench_offline.py
whose baseline the issue quotes, and each request's time to first token (p50/p90). Each prefill
also counts what could stall it (`stall_counts`: allocator retries, cudaMalloc/cudaFree, full
garbage collections), so a slow one can be told from a slow kernel. Every row carries the
engine's start-up and its split from vLLM's log (`--log`, bench/e2e/rows.py).

check: greedy tokens on a small Qwen3-MoE with real random weights (transformers, seeded) and
two adapters, in CHECK_BATCHES (adapters alone, beside base-model requests), then the time per
engine step of a 16 x 128-token decode. Modes: stock vLLM eager (`check-stock`, the reference),
the plugin eager (`check-plugin`), CUDA graphs per adapter count (vLLM's specialize_active_lora)
with the plugin (`check-plugin-graphs`) and without it (`check-stock-graphs`, vLLM 0.26's own
batch metadata, which drops an adapter beside base requests there:
`batch_metadata.fill_kernel_meta`), and an engine started without LoRA, eager and in graphs
(`check-base`, `check-base-graphs`), all requests on the base model. `--spec` adds speculative
decoding (`speculative_config`: n-gram, or the check model drafting for itself), `--tp` tensor
parallelism; the file is named by `check_label`.
`compare` pairs every run in DIR with its references (`comparisons`): the first 16 tokens of
every request against stock eager at the same TP, of the base requests against the engine
without LoRA in the same graph mode (base untouched), of a speculative run against the same run
without; and the margins at each flip.

The plugin is found through the `vllm.general_plugins` entry point in pyproject.toml: `--install`
writes a dist-info carrying that entry point into the first PYTHONPATH folder (the repository,
on PYTHONPATH, provides `loraplex`). The switch is LORAPLEX_ENGINE__MOE_LORA_KERNELS, inherited by
vLLM's engine processes: 0 for stock and base, 1 for plugin. Each mode runs in its own process.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import shutil
import statistics
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.e2e import poison_check
from bench.e2e.rows import log_since, median, startup_split
from bench.e2e.shapes import (
    MODELS,
    RANK,
    SMALL_CHECK,
    build_once,
    dims,
    make_adapter,
    make_model,
)
from bench.e2e.traces import summarize_traces
from loraplex.kernels.vllm.plugin import ENV_SWITCH, compile_cache_config

REPO = Path(__file__).resolve().parents[2]
# Prefills timed back to back in each repetition, each beside its clock and power; prefill_s is
# the first, which follows the previous repetition's decode, as the older rows' single prefill
# did. On the H200 the walls spread 0.37-0.48 s (base) with vLLM's engine core in its own
# process, back-to-back ones as much as first ones and at the same clock, and within 3% with the
# engine core in this process (rows marked engine_in_process).
PREFILLS_PER_REP = 3


def install_entry_point(site: Path) -> Path:
    """A dist-info whose entry_points.txt is pyproject's vllm.general_plugins section."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    info = site / f"loraplex-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: loraplex\nVersion: {project['version']}\n"
    )
    lines = ["[vllm.general_plugins]"] + [f"{k} = {v}" for k, v in plugins.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return info


def run_workload(ns: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model, adapter = Path(f"/tmp/e2e_model_{ns.model}"), Path(f"/tmp/e2e_lora_{ns.model}")
    cfg = make_model(model, ns.model, ns.layers)
    kw: dict = dict(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                    max_model_len=4096, gpu_memory_utilization=0.88, max_num_seqs=64,
                    tensor_parallel_size=ns.tp,
                    jit_monitor_verbose=True)  # fmt: skip  # logs every compile while serving
    if ns.mode != "base":
        make_adapter(adapter, dims(cfg), seed=0)
        # The compile-cache key follows the switch main() set for the plugin (one source).
        plugin_on = os.environ[ENV_SWITCH] == "1"
        kw.update(enable_lora=True, max_loras=8, max_lora_rank=RANK, max_cpu_loras=8,
                  lora_target_modules=ns.lora_targets,
                  additional_config=compile_cache_config(plugin_on))  # fmt: skip
    prof_dir = None
    if ns.profile in ("decode", "prefill"):
        # A folder of this run's own: runs side by side on two GPUs, or one after another, would
        # otherwise read each other's traces.
        prof_dir = Path(tempfile.mkdtemp(prefix=f"e2e_prof_{ns.mode}_{ns.profile}_"))
        # Decode: skip the few engine iterations that prefill 16 x 1600 tokens, then 20 steps.
        # Prefill: every iteration of one 16-prompt, 1-token generate.
        window = (0, 0) if ns.profile == "prefill" else (12, 20)
        kw["profiler_config"] = {
            "profiler": "torch", "torch_profiler_dir": str(prof_dir),
            "torch_profiler_with_stack": False, "delay_iterations": window[0],
            "max_iterations": window[1],
        }  # fmt: skip
    start = time.time()
    llm = LLM(**kw)
    startup = time.time() - start
    startup_parts = startup_split(log_since(ns.log, ns.log_offset))
    rnd = random.Random(0)

    def prompts() -> list[Any]:
        return [{"prompt_token_ids": [rnd.randrange(1000, 100000) for _ in range(1600)]}
                for _ in range(16)]  # fmt: skip

    lrs = None
    if ns.mode != "base":
        lrs = [LoRARequest(f"ad{i % 8}", i % 8 + 1, str(adapter)) for i in range(16)]
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    full = SamplingParams(max_tokens=600, ignore_eos=True, detokenize=False)
    warm = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    llm.generate(prompts()[:2], warm, lora_request=lrs[:2] if lrs else None, use_tqdm=False)
    llm.generate(prompts(), one, lora_request=lrs, use_tqdm=False)  # loads every adapter
    reps: list[dict[str, Any]] = []
    for i in range(ns.reps):
        # In vLLM's log format, so that its "JIT compilation during inference" lines from the
        # engine core can be placed in a repetition (slow ones came with such compiles).
        print(f"REP {i} starts {time.strftime('%m-%d %H:%M:%S')}", flush=True)
        prefills: list[dict[str, float]] = []
        for _ in range(PREFILLS_PER_REP):
            batch = prompts()  # drawn before the clock starts: 25,600 randrange calls
            before = stall_counts()
            with GpuClocks(interval_s=0.02) as prefill_clocks:
                t = time.time()
                llm.generate(batch, one, lora_request=lrs, use_tqdm=False)
                wall = time.time() - t
            after = stall_counts()
            prefills.append({"s": wall, **prefill_clocks.medians,
                             **{k: after[k] - before[k] for k in after}})  # fmt: skip
        prefill = prefills[0]["s"]
        batch = prompts()
        t = time.time()
        with GpuClocks() as clocks:
            streamed = stream_generate(llm, batch, full, lrs)
        total = time.time() - t
        print(f"REP {i} ends {time.strftime('%m-%d %H:%M:%S')}", flush=True)
        reps.append(
            {
                "prefill_s": prefill,
                "prefills": prefills,
                "total_s": total,
                "out_tokens": streamed.tokens,
                "otps_per_req": 599 / (total - prefill),
                "throughput": streamed.tokens / total,
                "ttft_p50_s": streamed.ttft_pct(50),
                "ttft_p90_s": streamed.ttft_pct(90),
                **clocks.medians,
            }
        )
    profile = None
    if ns.profile == "host":
        profile = profile_host(
            lambda: llm.generate(prompts(), one, lora_request=lrs, use_tqdm=False),
            ns.out / "host.samples",
        )
    elif prof_dir is not None:
        llm.start_profile()
        if ns.profile == "decode":
            decode = SamplingParams(max_tokens=48, ignore_eos=True, detokenize=False)
            llm.generate(prompts(), decode, lora_request=lrs, use_tqdm=False)
        else:
            llm.generate(prompts(), one, lora_request=lrs, use_tqdm=False)
        llm.stop_profile()
        # Per step of 20 decode steps, or per prefill of 16 x 1600 tokens.
        profile = summarize_traces(prof_dir, steps=20 if ns.profile == "decode" else 1)
        shutil.rmtree(prof_dir, ignore_errors=True)
    return {
        "startup_s": startup, "startup": startup_parts, "reps": reps,
        **({f"{ns.profile}_profile_us": profile} if ns.profile else {}),
        "otps_per_req_median": statistics.median(r["otps_per_req"] for r in reps),
        "prefill_s_median": statistics.median(r["prefill_s"] for r in reps),
        "ttft_p50_s": median([r["ttft_p50_s"] for r in reps]),
        "ttft_p90_s": median([r["ttft_p90_s"] for r in reps]),
    }  # fmt: skip


@dataclass
class Streamed:
    """What stream_generate saw: each request's output tokens and time to its first token,
    and the engine steps that returned output (one per step with the engine core's outputs
    reaching this process a step at a time, as vLLM's engine core sends them)."""

    tokens_per_request: list[list[int]]
    ttft_s: list[float]
    steps: int
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.tokens_per_request)

    def ttft_pct(self, q: float) -> float:
        import numpy as np

        return float(np.percentile(self.ttft_s, q))


def stream_generate(llm: Any, prompts: list[Any], params: Any, lrs: list[Any] | None) -> Streamed:
    """LLM.generate's loop (add every request, step the engine until none is left) with each
    request's tokens streamed as deltas, so that the time of its first token is seen: a
    streaming client in this process, where llm.generate hands back only finished requests.
    All requests are sent at once, as a benchmark client with 16 users starts."""
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    ids = [f"stream-{next(_REQUEST_IDS)}" for _ in prompts]
    start = time.perf_counter()
    sent = {}
    for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
        engine.add_request(rid, prompt, params, lora_request=lrs[i] if lrs else None)
        sent[rid] = time.perf_counter()
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        steps += bool(outputs)
        for out in outputs:
            new = list(out.outputs[0].token_ids)
            if new and out.request_id not in first:
                first[out.request_id] = now - sent[out.request_id]
            tokens[out.request_id] += new
    return Streamed([tokens[r] for r in ids], [first[r] for r in ids], steps,
                    time.perf_counter() - start)  # fmt: skip


_REQUEST_IDS = itertools.count()


# Events that stall a step and can differ from one prefill to the next: the CUDA caching
# allocator's retries (it frees its cached blocks and synchronizes the device, then allocates
# again), its cudaMalloc/cudaFree calls, and Python's full garbage collections. Counted in this
# process, which holds the model with the engine in process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def stall_counts() -> dict[str, int]:
    """Running totals of ALLOCATOR_COUNTS on GPU 0 and of generation-2 garbage collections."""
    import torch

    stats = torch.cuda.memory_stats()
    counts = {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTS}
    counts["gc_full_collections"] = gc.get_stats()[2]["collections"]
    return counts


class GpuClocks:
    """Median SM clock (MHz) and board power (W) of this process's first GPU (nvml_index) while
    the block runs, sampled by NVML every interval_s on a thread: kernels bound by latency
    rather than bytes slow down with the clock, and a prefill can reach the power cap, so a
    speed is read beside the clock it ran at."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s

    def __enter__(self) -> GpuClocks:
        import threading

        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        try:
            import pynvml  # nvidia-ml-py, a vLLM dependency
        except ImportError:
            print("GpuClocks: no pynvml, reps carry no clock", flush=True)
            return self
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index())

        def sample() -> None:
            while not self.done.wait(self.interval_s):
                self.samples.append((
                    pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                    pynvml.nvmlDeviceGetPowerUsage(handle) / 1000,
                ))  # fmt: skip

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.thread:
            self.thread.join()

    @property
    def medians(self) -> dict[str, float]:
        if not self.samples:
            return {}
        return {"sm_clock_mhz": statistics.median(c for c, _ in self.samples),
                "power_w": round(statistics.median(w for _, w in self.samples), 1)}  # fmt: skip


def nvml_index() -> int:
    """NVML's index of this process's first GPU: NVML counts every GPU of the machine, whatever
    CUDA_VISIBLE_DEVICES says (a session runs one list of modes on each of two GPUs)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


SAMPLED_PREFILLS = 8  # prefills py-spy samples, unprofiled: ~4 s at the ~0.5 s of one
PYSPY_RATE = 250  # samples/s: py-spy fell 40 s behind at 1,000/s on vLLM's many threads


def timed_prefills(prefill: Callable[[], Any]) -> list[float]:
    """The sampled prefills' walls; host_samples.py keeps the stacks through this function."""
    walls = []
    for _ in range(SAMPLED_PREFILLS):
        t = time.time()
        prefill()
        walls.append(time.time() - t)
    return walls


def sampled_prefills(prefill: Callable[[], Any], samples: Path) -> list[float]:
    """Unprofiled prefills and their walls; with LORAPLEX_PYSPY (the binary) set, py-spy
    attaches to this process for them and writes its raw stacks to `samples`."""
    import ctypes
    import signal
    import subprocess

    spy = None
    if binary := os.environ.get("LORAPLEX_PYSPY"):
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # Yama: let it trace us
        spy = subprocess.Popen(
            [binary, "record", "--pid", str(os.getpid()), "--rate", str(PYSPY_RATE), "--idle",
             "--nonblocking", "--nolineno", "--format", "raw", "-o", str(samples)]
        )  # fmt: skip
        time.sleep(2.0)  # attached before the first prefill
    walls = timed_prefills(prefill)
    if spy:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(timeout=120)
    return walls


def profile_host(prefill: Callable[[], Any], samples: Path, runs: int = 3) -> dict[str, Any]:
    """Where the host's time goes in a prefill of the 16 prompts, with the engine in this
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by main) so that the scheduler, the model
    runner and every Python call of the forward pass are on this thread: first the sampled
    prefills (see sampled_prefills), then cProfile over `runs` more, for call counts. Rows are
    ms per prefill. cProfile slows Python calls several times over, and its cumulative times
    are unreliable across torch.ops (the dispatcher calls back into Python), so read its call
    counts and self times, and py-spy's samples for where the time goes."""
    import cProfile
    import pstats

    walls = sampled_prefills(prefill, samples)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(runs):
        prefill()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]

    def rows(key: int, n: int) -> list[list[Any]]:
        top = sorted(stats.items(), key=lambda kv: -kv[1][key])[:n]
        return [
            [f"{Path(f).name}:{line}:{fn}", calls // runs, round(1e3 * tt / runs, 2),
             round(1e3 * ct / runs, 2)]
            for (f, line, fn), (_, calls, tt, ct, _) in top
        ]  # fmt: skip

    return {"prefill_s_sampled": walls, "columns": ["function", "calls", "self_ms", "cum_ms"],
            "by_cumulative": rows(3, 60), "by_self": rows(2, 40)}  # fmt: skip


def make_small_model(path: Path) -> None:
    """A small Qwen3-MoE with real random weights (seeded), saved by transformers."""

    def build(folder: Path) -> None:
        import torch
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        torch.manual_seed(0)
        shape: dict[str, Any] = dict(
            vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            num_experts=32, num_experts_per_tok=4, max_position_embeddings=2048,
        )  # fmt: skip
        model: Any = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape))
        model.to(torch.bfloat16).save_pretrained(folder)

    build_once(path, "config.json", build)


# Batch name -> the adapter of each request (None: the base model). Request i of a batch takes
# prompt i. The last batch makes the base requests 9 (of 20), each beside adapter requests.
CHECK_BATCHES: dict[str, list[int | None]] = {
    "two adapters": [0, 1, 0, 1],
    "two adapters beside base": [0, None, 1, None],
    "one adapter beside base": [0, None, None, None],
    "base between both adapters": [None, 0, None, 1, None, 0, None, 1],
}
# n-gram speculation as vLLM 0.26 takes it (config/speculative.py); it needs no draft model, and
# 0.26 refuses no LoRA with it (its punica wrapper sizes its buffers for the extra tokens).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip
SPECS = ("ngram", "draft")
STEP_TIMING = (16, 128)  # requests x output tokens of the check's decode timing


def speculative_config(spec: str, model: Path) -> dict[str, Any]:
    """vLLM 0.26's speculative_config for `--spec`: NGRAM, or (draft) the check model at `model`
    drafting for itself, 4 tokens a step. A draft model shares the target's vocabulary, which
    the check model trivially does. vLLM loads the drafter without LoRA (v1/spec_decode/
    draft_model.py), so an adapter request's drafts come from the base weights: that moves the
    acceptance, never the verified tokens, which the target computes with its adapter."""
    if spec == "ngram":
        return NGRAM
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 4}


def run_check(ns: argparse.Namespace) -> dict:
    """Greedy tokens of CHECK_BATCHES' requests in the mode's engine (see the docstring), then
    the engine's time per step over a decode of STEP_TIMING (adapters round robin)."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model = Path("/tmp/e2e_small")
    make_small_model(model)
    adapters = [Path(f"/tmp/e2e_small_lora{i}") for i in range(2)]
    for i, path in enumerate(adapters):
        make_adapter(path, SMALL_CHECK, seed=10 + i, scale=0.05)
    graphs = ns.mode.endswith("graphs")
    lora = "base" not in ns.mode  # check-base*: an engine started without LoRA
    kw: dict[str, Any] = dict(model=str(model), skip_tokenizer_init=True, max_model_len=512,
                              gpu_memory_utilization=0.3, enforce_eager=not graphs,
                              tensor_parallel_size=ns.tp)  # fmt: skip
    if lora:
        kw.update(enable_lora=True, max_loras=2, max_lora_rank=RANK, specialize_active_lora=graphs)
    if ns.spec:
        kw["speculative_config"] = speculative_config(ns.spec, model)
    start = time.time()
    llm = LLM(**kw)
    startup = time.time() - start
    startup_parts = startup_split(log_since(ns.log, ns.log_offset))
    rnd = random.Random(1)
    width = max(len(batch) for batch in CHECK_BATCHES.values())
    prompts: list[Any] = [
        {"prompt_token_ids": [rnd.randrange(10, 4000) for _ in range(32)]} for _ in range(width)
    ]
    lrs = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, detokenize=False)
    result: dict[str, Any] = {"startup_s": startup, "startup": startup_parts, "tokens": [],
                              "margins": []}  # fmt: skip
    for batch in CHECK_BATCHES.values():
        # vLLM takes None in the list for a request without adapter; its hint says otherwise.
        requests: list[Any] = [None if a is None or not lora else lrs[a] for a in batch]
        outs = llm.generate(prompts[: len(batch)], greedy, lora_request=requests, use_tqdm=False)
        for o in outs:
            result["tokens"].append(list(o.outputs[0].token_ids))
            # Per position, the greedy token's logprob lead over the runner-up: how near a tie
            # was.
            result["margins"].append([_lead(step) for step in o.outputs[0].logprobs or []])
    n, length = STEP_TIMING
    decode = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True, detokenize=False)
    timing_lrs = [lrs[i % 2] for i in range(n)] if lora else None
    for _ in range(2):  # the first warms up this batch's shapes
        timing_prompts = [{"prompt_token_ids": [rnd.randrange(10, 4000) for _ in range(32)]}
                          for _ in range(n)]  # fmt: skip
        streamed = stream_generate(llm, timing_prompts, decode, timing_lrs)
    result["step_timing"] = {
        "requests": n, "output_tokens": streamed.tokens, "steps": streamed.steps,
        "wall_s": streamed.wall_s, "ms_per_step": 1e3 * streamed.wall_s / streamed.steps,
        "tokens_per_step": streamed.tokens / streamed.steps,
    }  # fmt: skip
    return result


def _lead(step: dict[int, Any]) -> float:
    top = sorted((lp.logprob for lp in step.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


CHECK_MODES = ("check-plugin", "check-plugin-graphs", "check-stock-graphs", "check-base",
               "check-base-graphs")  # fmt: skip


def check_label(mode: str, tp: int = 1, spec: str | None = None) -> str:
    """The name of a check run's file: its mode, then -tpN and -SPEC where set."""
    return mode + (f"-tp{tp}" if tp > 1 else "") + (f"-{spec}" if spec else "")


def agreement(reference: dict[str, Any], row: dict[str, Any], adapters: list[int | None],
              base_only: bool = False) -> dict[str, Any]:  # fmt: skip
    """How many requests' first 16 greedy tokens in `row` equal `reference`'s (base_only: the
    requests without adapter alone); at each difference, the request, its adapter, the first
    different position and both runs' margins there (top-1 over top-2 logprob), so that a flip
    between near-tied tokens tells itself apart from a wrong kernel."""
    compared = differences = 0
    found = []
    for i, (want, got) in enumerate(zip(reference["tokens"], row["tokens"], strict=True)):
        if base_only and adapters[i] is not None:
            continue
        compared += 1
        at = _first_difference(want[:16], got[:16])
        if at is None:
            continue
        differences += 1
        found.append({"request": i, "adapter": adapters[i], "position": at,
                      "reference_margin": _margin(reference, i, at),
                      "margin": _margin(row, i, at)})  # fmt: skip
    return {"requests": compared, "agree": compared - differences, "differences": found}


def _first_difference(want: list[int], got: list[int]) -> int | None:
    """The first position where the two differ, or where one stopped (EOS) and the other not."""
    at = next((j for j, (x, y) in enumerate(zip(want, got, strict=False)) if x != y), None)
    if at is None and len(want) != len(got):
        at = min(len(want), len(got))
    return at


def _margin(row: dict[str, Any], request: int, position: int) -> float | None:
    margins = row["margins"][request]
    return margins[position] if position < len(margins) else None


def comparisons(labels: list[str]) -> list[tuple[str, str, bool]]:
    """(label, reference label, base requests only) for every check run in `labels` that has a
    reference among them: a LoRA run against stock eager at its tensor-parallel size (all
    requests) and against the engine without LoRA in the same graph mode (base requests: the
    base-untouched check); a speculative run against the same run without speculation."""
    have = set(labels)
    pairs = []
    for label in labels:
        spec = next((s for s in SPECS if label.endswith(f"-{s}")), None)
        plain = label.removesuffix(f"-{spec}") if spec else label
        tp = plain[plain.index("-tp") :] if "-tp" in plain else ""
        mode = plain.removesuffix(tp)
        if spec:
            pairs.append((label, plain, False))
            continue
        if mode.startswith("check-base"):
            continue
        if mode != "check-stock":
            pairs.append((label, "check-stock" + tp, False))
        graphs = "-graphs" if mode.endswith("graphs") else ""
        pairs.append((label, "check-base" + graphs + tp, True))
    return [(label, ref, base) for label, ref, base in pairs if ref in have]


def compare(out: Path) -> dict:
    """Every comparison (`comparisons`) of the check runs whose files are in `out`."""
    adapters = [a for batch in CHECK_BATCHES.values() for a in batch]
    rows = {path.stem.removeprefix("e2e_"): json.loads(path.read_text())
            for path in sorted(out.glob("e2e_check-*.json"))}  # fmt: skip
    result: dict[str, Any] = {"kind": "check-compare", "adapters": adapters, "agreement": {}}
    for label, ref, base_only in comparisons(list(rows)):
        entry = agreement(rows[ref], rows[label], adapters, base_only)
        which = "base requests" if base_only else "all requests"
        key = f"{label} vs {ref}" + (" (base)" if base_only else "")
        result["agreement"][key] = {"against": ref, "which": which, **entry}
    result["step_timing"] = {label: row["step_timing"] for label, row in rows.items()
                             if "step_timing" in row}  # fmt: skip
    return result


def engine_kind(mode: str) -> str:
    """base (no LoRA), stock (vLLM's LoRA kernels) or plugin (ours), from a mode's name."""
    return "plugin" if "plugin" in mode else "base" if "base" in mode else "stock"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    modes = ["base", "stock", "plugin", "check-stock", *CHECK_MODES, "compare",
             *poison_check.POISON_MODES, "poison-compare"]  # fmt: skip
    parser.add_argument("mode", choices=modes)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, help="fewer layers than the model's")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--spec", choices=SPECS, help="check modes: speculative decoding")
    parser.add_argument("--log", type=Path, help="the file this process's output goes to, "
                        "for vLLM's start-up lines")  # fmt: skip
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--profile", choices=["decode", "prefill", "host"],
        help="torch-profile 20 decode steps or one prefill of the 16 prompts; host: cProfile "
        "prefills with the engine in this process",
    )  # fmt: skip
    parser.add_argument("--install", type=Path, help="write the plugin's dist-info here first")
    parser.add_argument(
        "--lora-targets", nargs="+", metavar="MODULE",
        help="stock and plugin: vLLM's --lora-target-modules, the modules vLLM puts LoRA on "
        "(by default every one it supports, the MoE router included, which the workload's "
        "adapters never target)",
    )  # fmt: skip
    ns = parser.parse_args()
    if ns.lora_targets and ns.mode not in ("stock", "plugin"):
        parser.error("--lora-targets applies to the stock and plugin modes")
    ns.out.mkdir(parents=True, exist_ok=True)
    ns.log_offset = ns.log.stat().st_size if ns.log and ns.log.exists() else 0
    if ns.install:
        print("plugin entry point in", install_entry_point(ns.install), flush=True)
    if ns.mode == "compare":
        result = {"commit": ns.commit, **compare(ns.out)}
        for key, entry in result["agreement"].items():
            print("CHECK", key, json.dumps(entry))
        for label, timing in result["step_timing"].items():
            print("STEP", label, json.dumps(timing))
        (ns.out / "e2e_check.json").write_text(json.dumps(result) + "\n")
        return
    if ns.mode == "poison-compare":
        result = poison_check.compare(ns.out)
        for mode, entry in result.items():
            print("POISON", mode, json.dumps(entry))
        (ns.out / "e2e_poison.json").write_text(json.dumps(result) + "\n")
        return
    # Set before vLLM starts: its engine core and workers inherit it (loraplex.kernels.vllm.plugin).
    os.environ[ENV_SWITCH] = "1" if "plugin" in ns.mode else "0"
    if ns.profile == "host":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    run = run_check if ns.mode.startswith("check") else run_workload
    if ns.mode.startswith("poison"):
        run = poison_check.run_poison
    model = "check" if ns.mode.startswith(("check", "poison")) else ns.model
    label = check_label(ns.mode, ns.tp, ns.spec) if ns.mode.startswith("check") else ns.mode
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    row = {"mode": label, "model": model, "machine": machine, "commit": ns.commit,
           "layers": SMALL_CHECK.layers if model == "check"
           else ns.layers or MODELS[ns.model]["num_hidden_layers"], "tp": ns.tp,
           "engine": engine_kind(ns.mode), **run(ns)}  # fmt: skip
    # vLLM's LoRA switches set for this run (VLLM_LORA_ENABLE_DUAL_STREAM, ...), so rows from
    # runs that differ only there can be told apart.
    if lora_env := {k: v for k, v in os.environ.items() if k.startswith("VLLM_LORA_")}:
        row["vllm_lora_env"] = lora_env
    if ns.lora_targets:
        row["lora_target_modules"] = ns.lora_targets
    # The engine core in this process (host profiles, or set by hand to see whether requests
    # reaching a separate engine core one by one split a prefill into more steps).
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        row["engine_in_process"] = True
    tp = f"-tp{ns.tp}" if ns.tp > 1 else ""
    targets = "-targets" if "lora_target_modules" in row else ""
    name = label if model == "check" else f"{ns.mode}-{model}{tp}{targets}"
    (ns.out / f"e2e_{name}.json").write_text(json.dumps(row, indent=1) + "\n")
    print("RESULT", json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
