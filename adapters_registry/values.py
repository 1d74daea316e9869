"""Checking an adapter's values: every tensor read once, in bounded chunks, before it may serve.

A diverged fine-tune saves NaN or huge weights under a perfectly valid header; one request to such
an adapter used to turn every tenant's outputs to garbage. Each value must be finite, and within
`registry.max_weight_abs` as the engine serves it: lora_A as stored, lora_B times the adapter's
scaling (lora_alpha / r), which vLLM folds into B at load, so a huge lora_alpha cannot smuggle a
huge weight past the bound. Blocking; runs in a worker thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from loraplex.adapters_registry.peft_config import (
    CheckedConfig,
    PatternClock,
    invalid,
    pattern_value,
)
from loraplex.adapters_registry.tensors import DTYPE_BYTES, TensorInfo

# Bytes decoded at a time: memory stays a few times this whatever the tensor's size, and numpy's
# per-call overhead is negligible against it.
CHUNK_BYTES = 4 << 20
_NUMPY_DTYPES: dict[str, np.dtype[np.generic]] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
}  # fmt: skip


@dataclass(frozen=True)
class ServedTensor:
    """A tensor of the file and the factor the engine multiplies it by (1 for lora_A)."""

    info: TensorInfo
    scale: float


def served_scale(config: CheckedConfig, pattern_name: str, clock: PatternClock) -> float:
    """The factor lora_B of `pattern_name` is served at: alpha / r (alpha / sqrt(r) with
    use_rslora), per module with rank_pattern and alpha_pattern as vLLM 0.32 and PEFT take them,
    or for the whole adapter as vLLM 0.26 does (it ignores the patterns): the larger."""

    def scaling(rank: int, alpha: float) -> float:
        return abs(alpha) / (math.sqrt(rank) if config.use_rslora else rank)

    rank = pattern_value(config.ranks, pattern_name, clock, "rank_pattern")
    alpha = pattern_value(config.alphas, pattern_name, clock, "alpha_pattern")
    return max(scaling(rank, alpha), scaling(config.ranks[""], config.alphas[""]))


def check_values(path: Path, tensors: list[ServedTensor], max_abs: float) -> None:
    """Raise AdapterInvalid naming the first tensor that holds a non-finite value or one whose
    served magnitude exceeds `max_abs`, the value and where. Reads each tensor's bytes once."""
    with path.open("rb") as f:
        for tensor in sorted(tensors, key=lambda t: t.info.span):
            _check_tensor(f, tensor, max_abs)


def _check_tensor(f: BinaryIO, tensor: ServedTensor, max_abs: float) -> None:
    info = tensor.info
    # |stored| above this is past the bound once scaled (a zero scale serves zeros whatever B is).
    limit = max_abs / tensor.scale if tensor.scale > 0 else math.inf
    for first, values in _chunks(f, info):
        finite = np.isfinite(values)
        beyond = ~finite | (np.abs(values) > limit)
        if not beyond.any():
            continue
        flat = first + int(np.argmax(beyond))
        value = float(values[flat - first])
        at = [int(i) for i in np.unravel_index(flat, info.shape)]
        if not math.isfinite(value):
            raise invalid(
                "non_finite",
                f"tensor `{info.name}` holds {value} at {at}: adapter weights must be finite "
                "(a diverged fine-tune saves NaN or infinity)",
                info.name,
            )
        scaled = value * tensor.scale
        served = f" ({scaled:g} once scaled by lora_alpha/r)" if tensor.scale != 1 else ""
        raise invalid(
            "magnitude",
            f"tensor `{info.name}` holds {value:g} at {at}{served}: beyond "
            f"registry.max_weight_abs ({max_abs:g})",
            info.name,
        )


def _chunks(f: BinaryIO, info: TensorInfo) -> Iterator[tuple[int, np.ndarray]]:
    """(index of the first element, the values as float32) for each chunk of `info`'s bytes."""
    dtype, size = _NUMPY_DTYPES[info.dtype], DTYPE_BYTES[info.dtype]
    begin, end = info.span
    per_chunk = CHUNK_BYTES // size
    f.seek(begin)
    first = 0
    while first * size < end - begin:
        count = min(per_chunk, (end - begin) // size - first)
        raw = np.frombuffer(f.read(count * size), dtype=dtype)
        if len(raw) != count:
            raise invalid("truncated", f"tensor `{info.name}` ends before its bytes do", info.name)
        if info.dtype == "BF16":  # bfloat16 is the top half of a float32
            values = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.astype(np.float32, copy=False)
        yield first, values
        first += count
