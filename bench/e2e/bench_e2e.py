"""End to end on the device: base model, stock vLLM with LoRA, vLLM with the loraplex plugin.

    PYTHONPATH=/tmp/site:. python3 bench/e2e/bench_e2e.py MODE --commit SHA --out DIR
    MODE: base | stock | plugin | check-stock | check-plugin | check-plugin-graphs
          | check-stock-graphs | compare   (bench/e2e/run_device.sh check runs the four checks)
          | poison-stock | poison-plugin | poison-stock-graphs | poison-plugin-graphs
          | poison-compare   (run_device.sh poison runs the four: poison_check.py)

base/stock/plugin: the workload of issue 6 on a Qwen3-30B-A3B-shaped model with dummy weights
(48 layers, 128 experts top-8; `--layers` for fewer): 16 concurrent requests of 1600 prompt and
600 output tokens, 8 rank-32 adapters on attention and all experts, round robin, CUDA graphs on.
Per repetition (default 3, fresh prompts each, no prefix-cache hits): the prefill time of the 16
prompts (max_tokens=1) and the output tokens/s per request, (600 - 1) / (total - prefill), the
proxy of ../shared/gpu/example_bench_offline.py whose baseline the issue quotes. Each prefill
also counts what could stall it (`stall_counts`: allocator retries, cudaMalloc/cudaFree, full
garbage collections), so a slow one can be told from a slow kernel.

check: greedy tokens on a small Qwen3-MoE with real random weights (transformers, seeded) and
two adapters, in three batches: both adapters, both beside base-model requests, one beside them.
Modes: stock vLLM eager (`check-stock`, the reference), the plugin eager (`check-plugin`), and
CUDA graphs per adapter count (vLLM's specialize_active_lora) with the plugin
(`check-plugin-graphs`) and without it (`check-stock-graphs`, vLLM 0.26's own batch metadata,
which drops an adapter beside base requests there: `batch_metadata.fill_kernel_meta`). `compare`
counts the requests whose first 16 tokens agree with the reference.

The plugin is found through the `vllm.general_plugins` entry point in pyproject.toml: `--install`
writes a dist-info carrying that entry point into the first PYTHONPATH folder (the repository,
on PYTHONPATH, provides `loraplex`). The switch is LORAPLEX_ENGINE__MOE_LORA_KERNELS, inherited by
vLLM's engine processes: 0 for stock, 1 for plugin. Each mode runs in its own process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.e2e import poison_check
from bench.e2e.traces import summarize_traces
from loraplex.kernels.vllm.plugin import ENV_SWITCH, compile_cache_config

REPO = Path(__file__).resolve().parents[2]
# Prefills timed back to back in each repetition, each beside its clock and power; prefill_s is
# the first, which follows the previous repetition's decode, as the older rows' single prefill
# did. On the H200 the walls spread 0.37-0.48 s (base) with vLLM's engine core in its own
# process, back-to-back ones as much as first ones and at the same clock, and within 3% with the
# engine core in this process (rows marked engine_in_process).
PREFILLS_PER_REP = 3
H, I_MOE, EXPERTS, TOPK, RANK = 2048, 768, 128, 8, 32


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


# The Qwen3-30B-A3B shape of ../shared/gpu/example_make_model.py (num_hidden_layers is --layers).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
    "intermediate_size": 6144, "moe_intermediate_size": I_MOE, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": EXPERTS, "num_experts_per_tok": TOPK, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False,
}  # fmt: skip


def make_model(path: Path, layers: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of the Qwen3-30B-A3B shape with `layers` layers (and `overrides`, e.g. a tiny
    shape for a CPU dry run); returns the config."""
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": layers, **(overrides or {})}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


def make_adapter(path: Path, layers: int, hidden: int, inter: int, experts: int, q: int, kv: int,
                 seed: int, scale: float = 0.01) -> None:  # fmt: skip
    """A random rank-32 PEFT adapter on q/k/v/o and every expert's gate/up/down."""
    import torch
    from safetensors.torch import save_file

    if (path / "adapter_model.safetensors").exists():
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: dry runs of the scripts
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv),
              "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (q, hidden)}  # fmt: skip
    for e in range(experts):
        for name, io in {"gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                         "down_proj": (inter, hidden)}.items():  # fmt: skip
            shapes[f"mlp.experts.{e}.{name}"] = io
    tensors = {}
    for layer in range(layers):
        for mod, (i, o) in shapes.items():
            p = f"base_model.model.model.layers.{layer}.{mod}"
            a = torch.randn(RANK, i, device=device, generator=gen) * scale
            b = torch.randn(o, RANK, device=device, generator=gen) * scale
            tensors[p + ".lora_A.weight"] = a.bfloat16().cpu()
            tensors[p + ".lora_B.weight"] = b.bfloat16().cpu()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": targets,
        "bias": "none", "task_type": "CAUSAL_LM",
    }))  # fmt: skip


def run_workload(ns: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model, adapter = Path("/tmp/e2e_model"), Path("/tmp/e2e_lora")
    make_model(model, ns.layers)
    kw: dict = dict(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                    max_model_len=4096, gpu_memory_utilization=0.88, max_num_seqs=64,
                    jit_monitor_verbose=True)  # fmt: skip  # logs every compile while serving
    if ns.mode != "base":
        make_adapter(adapter, ns.layers, H, I_MOE, EXPERTS, 4096, 512, seed=0)
        # The compile-cache key follows the switch main() set for the plugin (one source).
        plugin_on = os.environ[ENV_SWITCH] == "1"
        kw.update(enable_lora=True, max_loras=8, max_lora_rank=RANK, max_cpu_loras=8,
                  additional_config=compile_cache_config(plugin_on))  # fmt: skip
    prof_dir = Path(f"/tmp/e2e_prof_{ns.mode}_{ns.profile}")
    if ns.profile:
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
        t = time.time()
        with GpuClocks() as clocks:
            outs = llm.generate(prompts(), full, lora_request=lrs, use_tqdm=False)
        total = time.time() - t
        print(f"REP {i} ends {time.strftime('%m-%d %H:%M:%S')}", flush=True)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        reps.append(
            {
                "prefill_s": prefill,
                "prefills": prefills,
                "total_s": total,
                "out_tokens": tokens,
                "otps_per_req": 599 / (total - prefill),
                "throughput": tokens / total,
                **clocks.medians,
            }
        )
    profile = None
    if ns.profile == "decode":
        llm.start_profile()
        llm.generate(prompts(), SamplingParams(max_tokens=48, ignore_eos=True, detokenize=False),
                     lora_request=lrs, use_tqdm=False)  # fmt: skip
        llm.stop_profile()
        profile = summarize_traces(prof_dir, steps=20)
    elif ns.profile == "prefill":
        llm.start_profile()
        llm.generate(prompts(), one, lora_request=lrs, use_tqdm=False)
        llm.stop_profile()
        profile = summarize_traces(prof_dir, steps=1)  # µs per prefill of 16 x 1600 tokens
    elif ns.profile == "host":
        profile = profile_host(
            lambda: llm.generate(prompts(), one, lora_request=lrs, use_tqdm=False),
            ns.out / "host.samples",
        )
    return {
        "startup_s": startup, "reps": reps,
        **({f"{ns.profile}_profile_us": profile} if ns.profile else {}),
        "otps_per_req_median": statistics.median(r["otps_per_req"] for r in reps),
        "prefill_s_median": statistics.median(r["prefill_s"] for r in reps),
    }  # fmt: skip


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
    """Median SM clock (MHz) and board power (W) of GPU 0 while the block runs, sampled by NVML
    every interval_s on a thread: kernels bound by latency rather than bytes slow down with the
    clock, and a prefill can reach the power cap, so a speed is read beside the clock it ran at."""

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
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)

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
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    shape: dict[str, Any] = dict(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        num_experts=32, num_experts_per_tok=4, max_position_embeddings=2048,
    )  # fmt: skip
    model: Any = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape))
    model.to(torch.bfloat16).save_pretrained(path)


# Batch name -> the adapter of each request (None: the base model).
CHECK_BATCHES: dict[str, list[int | None]] = {
    "two adapters": [0, 1, 0, 1],
    "two adapters beside base": [0, None, 1, None],
    "one adapter beside base": [0, None, None, None],
}


def run_check(ns: argparse.Namespace) -> dict:
    """Greedy tokens of CHECK_BATCHES' requests, in the mode's engine (see the docstring)."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model = Path("/tmp/e2e_small")
    make_small_model(model)
    adapters = [Path(f"/tmp/e2e_small_lora{i}") for i in range(2)]
    for i, path in enumerate(adapters):
        make_adapter(path, 4, 512, 256, 32, 512, 128, seed=10 + i, scale=0.05)
    graphs = ns.mode.endswith("graphs")
    llm = LLM(model=str(model), skip_tokenizer_init=True, max_model_len=512, enable_lora=True,
              max_loras=2, max_lora_rank=RANK, gpu_memory_utilization=0.3,
              enforce_eager=not graphs, specialize_active_lora=graphs)  # fmt: skip
    rnd = random.Random(1)
    prompts: list[Any] = [
        {"prompt_token_ids": [rnd.randrange(10, 4000) for _ in range(32)]} for _ in range(4)
    ]
    lrs = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, detokenize=False)
    result: dict[str, list] = {"tokens": [], "margins": []}
    for batch in CHECK_BATCHES.values():
        # vLLM takes None in the list for a request without adapter; its hint says otherwise.
        requests: list[Any] = [None if a is None else lrs[a] for a in batch]
        for o in llm.generate(prompts, greedy, lora_request=requests, use_tqdm=False):
            result["tokens"].append(list(o.outputs[0].token_ids))
            # Per position, the greedy token's logprob lead over the runner-up: how near a tie
            # was.
            result["margins"].append([_lead(step) for step in o.outputs[0].logprobs or []])
    return result


def _lead(step: dict[int, Any]) -> float:
    top = sorted((lp.logprob for lp in step.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


CHECK_MODES = ("check-plugin", "check-plugin-graphs", "check-stock-graphs")


def compare(out: Path) -> dict:
    """Per mode that ran (CHECK_MODES), against check-stock: how many requests' first 16 greedy
    tokens agree; where they do not, the request, its adapter, the position of the first
    difference and the reference's margin there (its top-1 over top-2 logprob), so that a flip
    between near-tied tokens tells itself apart from a wrong kernel."""
    reference = json.loads((out / "e2e_check-stock.json").read_text())
    adapters = [a for batch in CHECK_BATCHES.values() for a in batch]
    result: dict[str, Any] = {"stock": reference["tokens"], "adapters": adapters}
    for mode in CHECK_MODES:
        if not (out / f"e2e_{mode}.json").exists():
            continue
        tokens = json.loads((out / f"e2e_{mode}.json").read_text())["tokens"]
        differences = []
        for i, (a, b) in enumerate(zip(reference["tokens"], tokens, strict=True)):
            pairs = zip(a[:16], b[:16], strict=True)
            at = next((j for j, (x, y) in enumerate(pairs) if x != y), None)
            if at is not None:
                differences.append({"request": i, "adapter": adapters[i], "position": at,
                                    "stock_margin": reference["margins"][i][at]})  # fmt: skip
        result[mode] = {"requests": len(tokens), "agree_first_16": len(tokens) - len(differences),
                        "differences": differences, "tokens": tokens}  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    modes = ["base", "stock", "plugin", "check-stock", *CHECK_MODES, "compare",
             *poison_check.POISON_MODES, "poison-compare"]  # fmt: skip
    parser.add_argument("mode", choices=modes)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--profile", choices=["decode", "prefill", "host"],
        help="torch-profile 20 decode steps or one prefill of the 16 prompts; host: cProfile "
        "prefills with the engine in this process",
    )  # fmt: skip
    parser.add_argument("--install", type=Path, help="write the plugin's dist-info here first")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.install:
        print("plugin entry point in", install_entry_point(ns.install), flush=True)
    if ns.mode == "compare":
        result = compare(ns.out)
        for mode in CHECK_MODES:
            if mode in result:
                summary = {k: v for k, v in result[mode].items() if k != "tokens"}
                print("CHECK", mode, json.dumps(summary))
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
    row = {"mode": ns.mode, "machine": torch.cuda.get_device_name(), "commit": ns.commit,
           "layers": ns.layers, **run(ns)}  # fmt: skip
    # vLLM's LoRA switches set for this run (VLLM_LORA_ENABLE_DUAL_STREAM, ...), so rows from
    # runs that differ only there can be told apart.
    if lora_env := {k: v for k, v in os.environ.items() if k.startswith("VLLM_LORA_")}:
        row["vllm_lora_env"] = lora_env
    # The engine core in this process (host profiles, or set by hand to see whether requests
    # reaching a separate engine core one by one split a prefill into more steps).
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        row["engine_in_process"] = True
    (ns.out / f"e2e_{ns.mode}.json").write_text(json.dumps(row, indent=1) + "\n")
    print("RESULT", json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
