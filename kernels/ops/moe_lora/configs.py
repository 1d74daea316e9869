"""Launch configs of the MoE-LoRA kernels: tuned JSON per GPU name and shape, with a fallback.

Files live in `kernels/configs/moe_lora_<gpu slug>.json` and are written by
`python -m bench.kernels.tune_moe_lora`. Layout:

    {"gpu": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "sms": 132,
     "shapes": {"<shape key>": {"<num pairs>": {"variant": "split", "block_k": 128, ...}}}}

A lookup takes the entry of the nearest tuned pair count (in log scale) for the shape, or for a
one-slice shape without entries those of its two-slice twin (`tuned_entries`). A GPU without a
file of its own takes the file of a GPU of the same architecture and SM count (`_table`); an
unknown shape, or a GPU with no such sibling, gets `fallback_config`, a rule of thumb for
memory-bound skinny GEMMs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

CONFIG_DIR = Path(__file__).parents[2] / "configs"  # kernels/configs: tuned configs as data
log = logging.getLogger(__name__)
Variant = Literal["split", "fused", "stock"]
# Bounds on a per-thread register cap: the CUDA ABI's minimum and the most a thread can have on
# sm_90. A cap inside them can still be too low for a kernel: ptxas then fails its compile (the
# Qwen3 gate/up expand at prefill, half blocks, needs 94 on the H200).
MIN_REGISTERS, MAX_REGISTERS = 16, 255


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
    # split in the naive routing form (decode), on CUDA cores (`gemv_kernels`): the
    # shrink as a GEMV over whole K ranges, one program per pair, slice and range; the expand
    # as one over block_n columns, one program per pair, slice and N tile. (The fused
    # SiLU-and-mul's naive-form programs are GEMVs whatever this says.)
    gemv_shrink: bool = False
    gemv_expand: bool = False
    # The sorted form's block (BLOCK_M) the entry was tuned at: `lookup` serves it only to blocks
    # within BLOCK_M_TOLERANCE of that. None in the naive form, and where it was not recorded
    # (entries tuned at vLLM's blocks, before the plugin chose smaller ones), which serve any.
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


@dataclass(frozen=True)
class Gpu:
    """The GPU a config is for: its name picks its own file; its architecture and SM count, a
    sibling's file where it has none (a tuned config sets how many programs fill the SMs, and
    its register and shared-memory use, which the architecture bounds)."""

    name: str
    arch: str  # "sm_90"
    sms: int


def gpu_of(props: Any) -> Gpu:
    """The Gpu of torch.cuda.get_device_properties(index)'s answer."""
    return Gpu(props.name, f"sm_{props.major}{props.minor}", props.multi_processor_count)


def gpu_slug(gpu_name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in gpu_name).strip("_").lower()


@lru_cache(maxsize=16)
def _table(gpu: Gpu) -> dict[str, dict[int, MoeLoraConfig]]:
    """The GPU's own tuned shapes, over those of the first file (by name) of another GPU with the
    same architecture and SM count: a shape the GPU's own file lacks (a partial tune) keeps the
    sibling's entries rather than the fallback. The H100 SXM has no file of its own and shares
    the H200's sm_90 and 132 SMs; on the fallback instead, GPT-OSS's plugin decode ran at 0.737
    of base on an H100 (8924aae, docs/kernels.md), where the H200 with its file gave 0.790."""
    own_path = CONFIG_DIR / f"moe_lora_{gpu_slug(gpu.name)}.json"
    own = _parse(json.loads(own_path.read_text())) if own_path.is_file() else {}
    for path in sorted(CONFIG_DIR.glob("moe_lora_*.json")):
        raw = json.loads(path.read_text())
        if path != own_path and raw.get("arch") == gpu.arch and raw.get("sms") == gpu.sms:
            log.warning(
                "MoE-LoRA configs for %s: %s's (%s, %d SMs alike) where it has none of its own",
                gpu.name, raw["gpu"], gpu.arch, gpu.sms,
            )  # fmt: skip
            return _parse(raw) | own
    return own


def _parse(raw: dict[str, Any]) -> dict[str, dict[int, MoeLoraConfig]]:
    return {
        shape: {int(pairs): MoeLoraConfig(**cfg) for pairs, cfg in by_pairs.items()}
        for shape, by_pairs in raw["shapes"].items()
    }


# The naive form's fallback takes the GEMV expand up to this many pairs (unless pairs x slices
# already call for the fused launch) and the GEMV shrink up to the second bound: on the H200
# every tuned naive entry of 4 to 256 pairs chose the GEMV
# expand (Qwen3 and GPT-OSS, gate/up and down), and every one of up to 16 pairs the GEMV shrink
# (some up to 128); the tl.dot expand the fallback gave before took 45.7 us a layer for GPT-OSS's
# gate/up at 16 decode tokens there, about 7 tuned.
GEMV_EXPAND_PAIRS, GEMV_SHRINK_PAIRS = 256, 16


def fallback_config(key: ShapeKey, num_pairs: int, sm_count: int) -> MoeLoraConfig:
    """Split K while pairs x slices leave most SMs idle (decode), else one fused launch; in the
    naive form at decode sizes, on CUDA cores (the GEMV kernels) as every tuned entry there."""
    block_k = 128 if key.k >= 256 else 64
    programs = max(num_pairs * key.slices, 1)
    if programs >= 2 * sm_count or (key.sorted_form and num_pairs >= 1024):
        return MoeLoraConfig("fused", block_k=block_k, block_n=128)
    max_split = max(1, key.k // (2 * block_k))
    split = 1
    while split < max_split and programs * split < 4 * sm_count:
        split *= 2
    gemv_expand = not key.sorted_form and num_pairs <= GEMV_EXPAND_PAIRS
    return MoeLoraConfig(
        "split",
        block_k=block_k,
        block_n=256 if gemv_expand else 64,
        split_k=split,
        gemv_shrink=not key.sorted_form and num_pairs <= GEMV_SHRINK_PAIRS,
        gemv_expand=gemv_expand,
    )


# A config tuned at one sorted block serves blocks up to this factor away. H200, the fused configs
# tuned at block 16 (Qwen3 at 2,048 pairs, GPT-OSS at 1,024), on 16 pairs per slot-expert: at
# block 32 Qwen3 down 97.3 us (the best config tuned at 32: 97.6), at block 128 349.9, where the
# best tuned at 128 took 114.2; GPT-OSS gate/up 84.0 at 32, 272.8 at 128.
BLOCK_M_TOLERANCE = 2


def _serves_block(config: MoeLoraConfig, block_m: int) -> bool:
    tuned = config.tuned_block_m
    return tuned is None or max(tuned, block_m) <= BLOCK_M_TOLERANCE * min(tuned, block_m)


def lookup(gpu: Gpu, key: ShapeKey, num_pairs: int, block_m: int | None = None) -> MoeLoraConfig:
    """The tuned config nearest to num_pairs for this GPU and shape (`tuned_entries`; in the
    sorted form, among those that serve `block_m`), else the fallback."""
    tuned = tuned_entries(_table(gpu), key)
    if block_m is not None:
        tuned = {p: c for p, c in tuned.items() if _serves_block(c, block_m)}
    if not tuned:
        return fallback_config(key, num_pairs, gpu.sms)
    return tuned[_log_nearest(tuned, max(num_pairs, 1))]


def tuned_entries(
    shapes: dict[str, dict[int, MoeLoraConfig]], key: ShapeKey
) -> dict[int, MoeLoraConfig]:
    """The entries tuned for `key`. A one-slice key with none of its own and an even N takes
    those of the two-slice key of N/2 (any such key: the twin of a down call's key is no other
    call's, so in practice the 3D gate/up call). vLLM's 3D MoE-LoRA layout
    (`FusedMoE3DWithLoRA`, which serves GPT-OSS) makes the gate/up call with one A and one B of
    2 x I rows, gate and up interleaved, where the 2D layout has two of each: the expand covers
    the same columns per pair, the shrink half the products. With the fallback instead, that
    expand took 45.7 us a layer at 16 decode tokens on the H200 (GPT-OSS shape; docs/kernels.md)."""
    if own := shapes.get(key.text()):
        return own
    if key.slices == 1 and key.n % 2 == 0:
        return shapes.get(replace(key, n=key.n // 2, slices=2).text(), {})
    return {}


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


def write_configs(gpu: Gpu, shapes: dict[str, dict[int, MoeLoraConfig]]) -> Path:
    """Merge tuned entries into this GPU's file: a shape's pair counts not re-tuned (a run over
    fewer batches) keep their entries, as do shapes not re-tuned."""
    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    path = CONFIG_DIR / f"moe_lora_{gpu_slug(gpu.name)}.json"
    merged: dict[str, dict[str, dict[str, object]]] = {}
    if path.is_file():
        merged = json.loads(path.read_text())["shapes"]
    for shape, by_pairs in shapes.items():
        entries = {int(p): cfg for p, cfg in merged.get(shape, {}).items()}
        entries.update({p: cfg.to_json() for p, cfg in by_pairs.items()})
        merged[shape] = {str(p): cfg for p, cfg in sorted(entries.items())}
    header = {"gpu": gpu.name, "arch": gpu.arch, "sms": gpu.sms}
    path.write_text(json.dumps(header | {"shapes": merged}, indent=1) + "\n")
    _table.cache_clear()
    return path
