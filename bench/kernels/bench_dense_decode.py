"""Attention LoRA at decode sizes, as a decode step runs it: the base projection GEMM, then the
LoRA added into its output. Ours (`ops.lora_dense.op.lora_dense`, one launch a call), at
`launch_shape`'s shape and over a grid of launch shapes, against vLLM 0.26's `_lora_shrink` +
`_lora_expand` on the same inputs, in one run; each row's `lora_vs_vllm` is what vLLM's LoRA
adds to the GEMM over what ours adds (above 1: ours is faster).

    PYTHONPATH=/tmp/site:. python3 bench/kernels/bench_dense_decode.py --commit SHA --out DIR

Each call is `y = x @ W.T` (cuBLAS, as vLLM's unquantized linear) and then the LoRA into y, so a
row's time minus the GEMM-only time is what the LoRA adds to the step, launch overlap included.
Calls rotate over enough copies of W and of the adapters that each reads cold weights (a decode
step streams every layer's weights through L2). Tokens round robin over 8 rank-32 slots. Times
are medians per call in CUDA-graph replay, all variants replayed in turn (`time_interleaved`).
Writes JSON rows (machine, commit, config) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from vllm.lora.ops.triton_ops import LoRAKernelMeta
from vllm.lora.ops.triton_ops.lora_expand_op import _lora_expand
from vllm.lora.ops.triton_ops.lora_shrink_op import _lora_shrink

from bench.common import append_rows
from bench.kernels.moe_lora_workload import L2_BYTES, time_interleaved
from loraplex.kernels.ops.lora_dense.op import lora_dense
from loraplex.kernels.ops.moe_lora.configs import gpu_slug

SLOTS, RANK = 8, 32
LAYERS = {  # layer: (K, slice widths), Qwen3-30B-A3B attention
    "qkv": (2048, [4096, 512, 512]),
    "o": (4096, [2048]),
}
TOKENS = (1, 4, 16, 64)
BLOCK_NS, SPLITS = (64, 128, 256), (4, 8, 16, 32)


def shapes(k: int) -> list[tuple[int | None, int | None]]:
    """(block_n, split_k) to time: `launch_shape`'s (None, None), then a grid (K ranges of at
    least one 128-wide block)."""
    grid = [(n, s) for n in BLOCK_NS for s in SPLITS if s * 128 <= k]
    return [(None, None), *grid]


def one_set(k: int, widths: list[int], tokens: int, gen: torch.Generator) -> dict:
    dtype = torch.bfloat16
    n = sum(widths)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, device="cuda", generator=gen) * scale).to(dtype)

    return {
        "w": randn(n, k, scale=k**-0.5),
        "a": [randn(SLOTS, 1, RANK, k, scale=k**-0.5) for _ in widths],
        "b": [randn(SLOTS, 1, w, RANK, scale=1 / 8) for w in widths],
        "x": randn(tokens, k),
        "y": torch.empty(tokens, n, device="cuda", dtype=dtype),
    }


def set_bytes(s: dict) -> int:
    return sum(t.numel() * t.element_size() for t in (s["w"], *s["a"], *s["b"]))


def bench_layer(layer: str, tokens: int) -> list[dict]:
    k, widths = LAYERS[layer]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    first = one_set(k, widths, tokens, gen)
    copies = max(2, -(-4 * L2_BYTES // set_bytes(first)))
    sets = [first] + [one_set(k, widths, tokens, gen) for _ in range(copies - 1)]
    mapping = (torch.arange(tokens, device="cuda") % SLOTS).to(torch.int32)
    meta = LoRAKernelMeta.make(SLOTS, tokens, device="cuda")
    meta.prepare_tensors(mapping)
    args = meta.meta_args(tokens, False)
    buffer = torch.empty((len(widths), tokens, RANK), dtype=torch.float32, device="cuda")

    def gemm(s: dict) -> None:
        torch.mm(s["x"], s["w"].t(), out=s["y"])

    def theirs(s: dict) -> None:
        gemm(s)
        _lora_shrink(s["x"], s["a"], buffer, *args, 1.0)
        _lora_expand(buffer, s["b"], s["y"], *args, offset_start=0, add_inputs=True)

    def ours(s: dict, block_n: int | None, split_k: int | None) -> None:
        gemm(s)
        lora_dense(s["y"], s["x"], s["a"], s["b"], mapping, 1.0, True, split_k, block_n)

    theirs(first)
    want = first["y"].float().clone()
    variants = {"gemm": [functools.partial(gemm, s) for s in sets],
                "vllm": [functools.partial(theirs, s) for s in sets]}  # fmt: skip
    errs = {}
    for block_n, split_k in shapes(k):
        name = f"ours n{block_n} k{split_k}" if block_n else "ours launch_shape"
        variants[name] = [functools.partial(ours, s, block_n, split_k) for s in sets]
        variants[name][0]()
        errs[name] = float((first["y"].float() - want).norm() / want.norm())
    times = dict(zip(variants, time_interleaved(list(variants.values())), strict=True))
    base = times["gemm"]
    rows = []
    for name, us in times.items():
        if name == "gemm":
            continue
        rows.append({"layer": layer, "tokens": tokens, "variant": name, "call_us": us,
                     "gemm_us": base, "lora_us": us - base,
                     "lora_vs_vllm": (times["vllm"] - base) / (us - base),
                     "rel_err_vs_vllm": errs.get(name, 0.0), "weight_sets": copies})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ns = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    rows = []
    for layer in LAYERS:
        for tokens in ns.tokens:
            for row in bench_layer(layer, tokens):
                # Rows without `form` timed the op's earlier two-launch form.
                row.update(machine=gpu, commit=ns.commit, rank=RANK, slots=SLOTS,
                           dtype="bfloat16", form="one_launch")  # fmt: skip
                rows.append(row)
                print(f"{layer:4s} T={tokens:3d} {row['variant']:20s} call {row['call_us']:7.2f} "
                      f"gemm {row['gemm_us']:7.2f} lora {row['lora_us']:6.2f} us "
                      f"x{row['lora_vs_vllm']:5.2f} vs vllm err {row['rel_err_vs_vllm']:.1e}",
                      flush=True)  # fmt: skip
    print("wrote", append_rows(f"dense_decode_{gpu_slug(gpu)}", rows, ns.out))


if __name__ == "__main__":
    main()
