"""Launch configs of the MoE-LoRA kernels: tuned JSON per GPU name and shape, with a fallback.

Files live in `kernels/configs/moe_lora_<gpu slug>.json` and are written by
`python -m loraplex.kernels.tune_moe_lora`. Layout:

    {"gpu": "NVIDIA H100 80GB HBM3",
     "shapes": {"<shape key>": {"<num pairs>": {"variant": "split", "block_k": 128, ...}}}}

A lookup takes the entry of the nearest tuned pair count (in log scale) for the shape; an unknown
GPU or shape gets `fallback_config`, a rule of thumb for memory-bound skinny GEMMs.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

CONFIG_DIR = Path(__file__).parent / "configs"
Variant = Literal["split", "fused", "stock"]
# Bounds on a per-thread register cap: the CUDA ABI's minimum and the most a thread can have on
# sm_90. A cap inside them can still be too low for a kernel: ptxas then fails its compile (the
# Qwen3 gate/up expand at prefill, half blocks, needs 94 on the H200).
MIN_REGISTERS, MAX_REGISTERS = 16, 255


# Our kernels take decode batches in the naive routing form (a program per pair) while
# pairs <= experts x max_loras (one pair per (adapter slot, expert) on average over vLLM's slots),
# and NAIVE_MAX_PAIRS at most, where vLLM's rule (pairs x 8 <= experts x max_loras) sorts them
# from an eighth of that: the plugin widens the rule (`plugin._routing_for_our_kernels`). H200, 8
# slots, each form tuned on the same routing, naive against sorted (us, gate/up and down; 64 and
# 256 pairs of GPT-OSS-20B and 512 of Qwen3-30B-A3B from bench_moe_lora's rows at c604845, the
# rest from a probe):
#   GPT-OSS (32 experts): 64 pairs 17.7 / 21.6 and 10.6 / 15.0; 256 pairs 44.0 / 48.5 and
#     25.1 / 28.0; 512 pairs 74.0 / 57.3 and 39.1 / 36.3; 1,024 pairs 138.1 / 63.0.
#   Qwen3 (128 experts): 512 pairs 43.7 / 45.8 and 25.3 / 28.0; 1,024 pairs 78.9 / 81.6 and
#     42.8 / 45.6; 2,048 pairs (down) 78.2 / 55.5.
# The cap is the largest batch measured in the naive form.
# Against the sorted form in the plugin's blocks of 16 (`serves_block_m`; probe at 46a0245, same
# measure): GPT-OSS 128 pairs 28.0 / 31.1 and 16.0 / 19.0, 256 pairs 44.3 / 42.0 and 24.9 / 25.4;
# Qwen3 512 pairs 43.5 / 47.0 and 25.6 / 28.1, 1,024 pairs 77.9 / 63.8 and 42.6 / 41.3. At one
# pair per slot-expert the sorted layer (both calls) is 2% faster for GPT-OSS and 13% for Qwen3,
# before the align it needs and the naive form skips (vLLM's op: 9.8 us at 512 pairs, 16.4 at
# 2,048, `plugin.ALIGN_MIN_PAIRS`): GPT-OSS stays ahead naive, Qwen3 would gain about 2%, so the
# bound stays.
# All of the above spreads the tokens round robin over the adapters. The naive form reads a
# (slot, expert) once per pair routed to it, so with one adapter on every token it reads the
# same bytes up to 8 times over (bench_moe_lora --popularity, rows of 040e008: Qwen3 gate/up at
# 128 tokens 60.7 us against vLLM's 35.3). A layer's LoRA (gate/up + down + our align, which
# only the sorted form needs), sorted in blocks of 16 over naive, on the H200 (a throwaway probe
# at 4ce3c7e, this configs file, one run):
#   round robin / zipf / one adapter: Qwen3 at 128 tokens 1.16 / 1.05 / 0.58 (58.2 against
#   100.2 us); at 64 tokens 1.24 / 1.25 / 1.04; GPT-OSS at 64 tokens 1.07 / 1.03 / 0.82; at 16
#   tokens, one adapter (an earlier run of the probe), GPT-OSS sorted took 37.4 against 24.0
#   naive, Qwen3 46.9 against 21.4.
# So where the plugin knows how many adapters a batch holds (`plugin._active_loras`: under
# vLLM's specialize_active_lora, which captures a CUDA graph per count), the naive form also
# needs at most NAIVE_PAIRS_PER_ACTIVE_SLOT_EXPERT pairs per (active adapter, expert): one
# adapter sorts Qwen3 from 65 tokens and GPT-OSS from 33, and keeps 16 tokens naive for both.
# Without that setting vLLM rounds every count up to max_loras + 1 and the bounds above decide.
# That setting is safe only with the plugin's batch metadata: vLLM 0.26 keys a graph on the
# batch's adapters while its own count also counts the no-adapter id -1, which it sorts first,
# so one adapter beside base-model requests replayed the one-adapter graph, whose kernels
# covered id -1 only (H200, stock vLLM, a small random Qwen3-MoE, greedy: with it on, the
# adapter's requests left their eager-mode tokens from the first token; bench_e2e check, rows in
# bench/e2e/results/e2e_check_nvidia_h200.json). `lora_mapping.fill_kernel_meta` counts
# adapters only and sorts -1 last; with it the same check kept the tokens of every adapter request
# beside base requests (two runs; the only flips were at exact or near ties).
# End to end with graphs per count (bench_adapter_count, 8-layer Qwen3 shape, 128 requests, all
# on one adapter): 27.3k against 21.0k output tok/s with graphs for any count.
NAIVE_PAIRS_PER_SLOT_EXPERT = 1
NAIVE_MAX_PAIRS = 1024
NAIVE_PAIRS_PER_ACTIVE_SLOT_EXPERT = 4


def serves_naive(
    num_pairs: int,
    experts: int,
    max_loras: int,
    vllm_naive: bool,
    active_loras: int | None = None,
) -> bool:
    """Whether a call of num_pairs pairs runs in the naive routing form once the plugin is in:
    where vLLM's own rule says so, and while the pairs fit the bounds above, those of the
    batch's active adapters too where their count is known."""
    dense = num_pairs > NAIVE_PAIRS_PER_SLOT_EXPERT * experts * max_loras
    crowded = (
        active_loras is not None
        and num_pairs > NAIVE_PAIRS_PER_ACTIVE_SLOT_EXPERT * experts * active_loras
    )
    return vllm_naive or (num_pairs <= NAIVE_MAX_PAIRS and not dense and not crowded)


# In the sorted form vLLM pads each (adapter slot, expert) group of pairs to blocks of its MoE
# config's BLOCK_SIZE_M: by default 64 from 97 tokens, 128 from 513 (a tuned file may differ:
# vLLM's H200 file for Qwen3-30B-A3B gives 32 at 256 tokens). Between decode and prefill sizes the
# groups hold a few pairs each, and our kernels multiply mostly padding rows, so the plugin asks
# for smaller blocks there (`plugin._routing_for_our_kernels`): 16 while the pairs average at
# most 8 per (slot, expert) over vLLM's slots, 32 up to 16, 64 up to 32; denser batches keep
# vLLM's block.
# H200, 8 slots, our op tuned at each block on the same routing, vLLM's default block against 32
# and 16 (us, gate/up and down):
#   Qwen3-30B-A3B: 256 tokens (2 pairs per slot-expert, default 64) 106.9 / 104.7 / 87.1 and
#     61.7 / 56.2 / 51.5; 512 tokens (4, 64) 116.3 / 113.9 / 99.9 and 69.6 / 68.8 / 61.0;
#     1,024 tokens (8, 128) 166.4 / 121.4 / 108.7 and 100.0 / 73.5 / 71.0; 2,048 tokens (16,
#     128; down) 114.2 / 97.6 / 103.1 (64: 102.3).
#   GPT-OSS-20B: 128 tokens (2, 64) 58.4 / 59.1 / 56.6 and 36.3 / 33.1 / 32.4; 256 tokens (4,
#     64) 64.4 / 66.2 / 63.8 and 39.5 / 37.1 / 36.2; 512 tokens (8, 64) 69.8 / 71.3 / 68.7 and
#     43.4 / 41.3 / 41.0; 1,024 tokens (16, 128; down) 70.9 / 54.1 / 55.3 (64: 55.6).
# With the configs the file serves (`lookup`), vLLM's block 128 against 64: at 32 pairs per
# slot-expert (Qwen3 4,096 tokens, GPT-OSS 2,048) gate/up 204.2 / 178.1 and 189.2 / 150.2, down
# 151.8 / 147.5 and 112.5 / 91.8; at 64 (8,192 and 4,096 tokens) gate/up 266.8 / 265.0 and
# 245.5 / 227.3, down 235.1 / 241.3 and 147.9 / 139.3, so denser batches keep vLLM's block
# (prefill: 200 per slot-expert for Qwen3 at 16 x 1,600 tokens).
SMALL_BLOCKS = ((8, 16), (16, 32), (32, 64))  # (most pairs per slot-expert on average, block)


def serves_block_m(num_pairs: int, experts: int, max_loras: int, vllm_block_m: int) -> int:
    """The sorted form's block size once the plugin is in: SMALL_BLOCKS' where the pairs are
    sparse enough, never larger than vLLM's own."""
    for most, block in SMALL_BLOCKS:
        if num_pairs <= most * experts * max_loras:
            return min(block, vllm_block_m)
    return vllm_block_m


@dataclass(frozen=True)
class MoeLoraConfig:
    """How to launch one call. split: shrink over SPLIT_K K ranges, then expand; fused: one kernel
    with the intermediate on chip, each program covering 1/npid of N; stock: vLLM's own kernel
    was measured faster here, so the op declines and the plugin hands the call to vLLM."""

    variant: Variant
    block_k: int
    block_n: int
    split_k: int = 1
    npid: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fuse_slices: bool = False  # 2 slices: one (shrink) program does gate and up, gathering x once
    # split's expand: each program takes 1/expand_parts of a sorted block's rows (smaller tiles,
    # more programs per SM) and expand_tiles adjacent N tiles, loading the next while it stores.
    expand_parts: int = 1
    expand_tiles: int = 1
    # A cap on registers per thread (ptxas's maxnreg) for the op's kernels (shrink and expand, or
    # the fused kernel); None leaves the compiler's choice. A program of 4 warps that uses just
    # over 128 registers fits one fewer per SM than one held to 128.
    max_registers: int | None = None
    # split in the naive routing form (decode), on CUDA cores (`moe_lora_gemv_triton`): the
    # shrink as a GEMV over whole K ranges, one program per pair, slice and range; the expand
    # as one over block_n columns, one program per pair, slice and N tile. (The fused
    # SiLU-and-mul's naive-form programs are GEMVs whatever this says.)
    gemv_shrink: bool = False
    gemv_expand: bool = False
    # The sorted form's block (BLOCK_M) the entry was tuned at: `lookup` serves it only to blocks
    # within BLOCK_M_TOLERANCE of that. None in the naive form, and where it was not recorded
    # (entries tuned before 98a0c8f, at vLLM's blocks), which serve any block.
    tuned_block_m: int | None = None

    def __post_init__(self) -> None:
        if self.gemv_shrink and (self.variant != "split" or self.fuse_slices):
            raise ValueError(
                "gemv_shrink is a shrink of the split variant, one slice a program: variant must "
                f"be 'split' (got {self.variant!r}) and fuse_slices False (got {self.fuse_slices})"
            )
        if self.gemv_expand and (self.variant != "split" or self.expand_tiles != 1):
            raise ValueError(
                "gemv_expand is an expand of the split variant over block_n columns a program: "
                f"variant must be 'split' (got {self.variant!r}) and expand_tiles 1 "
                f"(got {self.expand_tiles})"
            )
        parts = self.expand_parts
        if parts < 1 or parts & (parts - 1):
            raise ValueError(f"expand_parts must be a power of 2 >= 1, got {parts}")
        if self.expand_tiles < 1:
            raise ValueError(f"expand_tiles must be >= 1, got {self.expand_tiles}")
        regs = self.max_registers
        if regs is not None and not MIN_REGISTERS <= regs <= MAX_REGISTERS:
            raise ValueError(
                f"max_registers must be between {MIN_REGISTERS} and {MAX_REGISTERS}, got {regs}"
            )

    def launch_options(self) -> dict[str, int]:
        """Triton launch options: warps, and the register cap where one is set."""
        regs = {} if self.max_registers is None else {"maxnreg": self.max_registers}
        return {"num_warps": self.num_warps} | regs

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ShapeKey:
    """What a config depends on besides the batch: the weights' shape and the routing form."""

    k: int
    n: int
    slices: int
    rank: int
    experts: int
    top_k: int
    sorted_form: bool
    dtype: str

    def text(self) -> str:
        form = "sorted" if self.sorted_form else "naive"
        return (
            f"K={self.k},N={self.n},S={self.slices},R={self.rank},E={self.experts},"
            f"topk={self.top_k},{form},{self.dtype}"
        )


def gpu_slug(gpu_name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in gpu_name).strip("_").lower()


@lru_cache(maxsize=16)
def _load(gpu_name: str) -> dict[str, dict[int, MoeLoraConfig]]:
    path = CONFIG_DIR / f"moe_lora_{gpu_slug(gpu_name)}.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {
        shape: {int(pairs): MoeLoraConfig(**cfg) for pairs, cfg in by_pairs.items()}
        for shape, by_pairs in raw["shapes"].items()
    }


def fallback_config(key: ShapeKey, num_pairs: int, sm_count: int) -> MoeLoraConfig:
    """Split K while pairs x slices leave most SMs idle (decode), else one fused launch."""
    block_k = 128 if key.k >= 256 else 64
    programs = max(num_pairs * key.slices, 1)
    if programs >= 2 * sm_count or (key.sorted_form and num_pairs >= 1024):
        return MoeLoraConfig("fused", block_k=block_k, block_n=128)
    max_split = max(1, key.k // (2 * block_k))
    split = 1
    while split < max_split and programs * split < 4 * sm_count:
        split *= 2
    return MoeLoraConfig("split", block_k=block_k, block_n=64, split_k=split)


# A config tuned at one sorted block serves blocks up to this factor away. H200, the fused configs
# tuned at block 16 (Qwen3 at 2,048 pairs, GPT-OSS at 1,024), on 16 pairs per slot-expert: at
# block 32 Qwen3 down 97.3 us (the best config tuned at 32: 97.6), at block 128 349.9, where the
# best tuned at 128 took 114.2; GPT-OSS gate/up 84.0 at 32, 272.8 at 128.
BLOCK_M_TOLERANCE = 2


def _serves_block(config: MoeLoraConfig, block_m: int) -> bool:
    tuned = config.tuned_block_m
    return tuned is None or max(tuned, block_m) <= BLOCK_M_TOLERANCE * min(tuned, block_m)


def lookup(
    gpu_name: str, key: ShapeKey, num_pairs: int, sm_count: int, block_m: int | None = None
) -> MoeLoraConfig:
    """The tuned config nearest to num_pairs for this GPU and shape (in the sorted form, among
    those that serve `block_m`), else the fallback."""
    tuned = _load(gpu_name).get(key.text(), {})
    if block_m is not None:
        tuned = {p: c for p, c in tuned.items() if _serves_block(c, block_m)}
    if not tuned:
        return fallback_config(key, num_pairs, sm_count)
    return tuned[_log_nearest(tuned, max(num_pairs, 1))]


def _log_nearest(entries: Collection[int], num_pairs: int) -> int:
    """The entry nearest num_pairs on a log scale, the larger of two equally near: one of the
    entries on either side, compared exactly (num_pairs / below against above / num_pairs, in
    integers). Compared as float logs, an exact geometric midpoint (2,048 pairs between entries
    at 1,024 and 4,096) went to whichever side rounding favoured, which differed between the
    midpoints of one file. Integers, not fractions: this runs at every op call, and over 13
    entries it takes 0.9-1.8 us, float logs 3.0 and Fractions 29 (CPython 3.11)."""
    below = [p for p in entries if p <= num_pairs]
    above = [p for p in entries if p >= num_pairs]
    if not below:
        return min(above)
    if not above:
        return max(below)
    lo, hi = max(below), min(above)
    return hi if hi * lo <= num_pairs * num_pairs else lo


def write_configs(gpu_name: str, shapes: dict[str, dict[int, MoeLoraConfig]]) -> Path:
    """Merge tuned entries into this GPU's file: a shape's pair counts not re-tuned (a run over
    fewer batches) keep their entries, as do shapes not re-tuned."""
    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    path = CONFIG_DIR / f"moe_lora_{gpu_slug(gpu_name)}.json"
    merged: dict[str, dict[str, dict[str, object]]] = {}
    if path.is_file():
        merged = json.loads(path.read_text())["shapes"]
    for shape, by_pairs in shapes.items():
        entries = {int(p): cfg for p, cfg in merged.get(shape, {}).items()}
        entries.update({p: cfg.to_json() for p, cfg in by_pairs.items()})
        merged[shape] = {str(p): cfg for p, cfg in sorted(entries.items())}
    path.write_text(json.dumps({"gpu": gpu_name, "shapes": merged}, indent=1) + "\n")
    _load.cache_clear()
    return path
