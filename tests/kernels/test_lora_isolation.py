"""An adapter slot of NaN or 1e30 weights changes no other token's output, in any kernel form the
plugin uses, and a later call with that slot loaded but unused is clean (`kernel_isolation`
says how). CPU interpreter in fp32 (NaN) and fp16 (1e30, which fp16 stores as inf); bf16 runs in
test_lora_isolation_gpu.py on the device. `moe_lora_sum`'s own rule (a delta row counts only
for a token on an active slot) is held with NaN rows in test_moe_lora_sum.py.

Each kernel runs at least once, on small cases (the interpreter runs programs one by one):
masking, not sizes, is what leaks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig
from tests.support.kernel_isolation import (
    POISONS,
    check_dense,
    check_expand_activation,
    check_moe_op,
)
from tests.support.moe_lora_cases import Case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32, FP16 = torch.float32, torch.float16

SPLIT = MoeLoraConfig("split", block_k=32, block_n=32, split_k=2)
FUSED = MoeLoraConfig("fused", block_k=32, block_n=32, npid=2)
FUSED_SLICES = MoeLoraConfig("fused", block_k=32, block_n=32, fuse_slices=True)
# Gate and up in one shrink program, half-block expand programs over two N tiles.
SPLIT_SLICES = MoeLoraConfig(
    "split", block_k=32, block_n=32, split_k=2, fuse_slices=True, expand_parts=2, expand_tiles=2
)
GEMV_BOTH = MoeLoraConfig("split", block_k=32, block_n=32, split_k=2, gemv_shrink=True,
                          gemv_expand=True)  # fmt: skip

# Three slots, slot 0 poisoned, tokens on none too; N = 40 leaves a partial tile.
GATE_UP = Case(8, 2, 8, 16, 3, "distinct", no_adapter=0.3, k=64, n=40)
# The down call as the plugin's side stream makes it: the delta alone (add_inputs False).
DOWN_DELTA = Case(6, 2, 8, 16, 3, "distinct", no_adapter=0.3, mul_routed_weight=True, slices=1,
                  k=48, n=40, add_inputs=False)  # fmt: skip
# Blocks of 16 in vLLM's order of the batch's slots (-1 first, every slot counted) and in the
# plugin's (-1 last, the adapters counted).
SORTED = Case(16, 2, 4, 8, 3, "distinct", no_adapter=0.3, k=64, n=40, sorted_form=True)
SORTED_PLUGIN = dataclasses.replace(SORTED, specialize_active=True)
SORTED_DOWN_DELTA = dataclasses.replace(SORTED, slices=1, mul_routed_weight=True, add_inputs=False)
# GPT-OSS's gate/up call in vLLM's 3D layout: one slice, gate and up interleaved (swigluoai).
GATE_UP_3D = dataclasses.replace(GATE_UP, slices=1, n=80)
SORTED_PLUGIN_3D = dataclasses.replace(SORTED_PLUGIN, slices=1, n=80)

OP_CALLS = {
    "naive_split": (GATE_UP, SPLIT, FP32, "nan"),
    "naive_split_fp16_huge": (GATE_UP, SPLIT, FP16, "huge"),
    "naive_fused": (GATE_UP, FUSED, FP32, "nan"),
    "naive_fused_slices": (GATE_UP, FUSED_SLICES, FP32, "nan"),
    "naive_split_slices": (GATE_UP, SPLIT_SLICES, FP32, "nan"),
    "naive_gemv": (GATE_UP, GEMV_BOTH, FP32, "nan"),
    "naive_down_delta_split": (DOWN_DELTA, SPLIT, FP32, "nan"),
    "naive_down_delta_gemv_fp16_huge": (DOWN_DELTA, GEMV_BOTH, FP16, "huge"),
    "sorted_split": (SORTED, SPLIT, FP32, "nan"),
    "sorted_split_fp16_huge": (SORTED, SPLIT, FP16, "huge"),
    "sorted_fused": (SORTED, FUSED, FP32, "nan"),
    "sorted_plugin_order_split_slices": (SORTED_PLUGIN, SPLIT_SLICES, FP32, "nan"),
    "sorted_down_delta_fused": (SORTED_DOWN_DELTA, FUSED, FP32, "nan"),
}


@pytest.mark.parametrize("name", list(OP_CALLS))
def test_moe_lora_op(name: str) -> None:
    case, config, dtype, poison = OP_CALLS[name]
    check_moe_op(case, config, dtype, DEVICE, POISONS[poison])


ACT_CALLS = {
    "naive_gemv": (GATE_UP, GEMV_BOTH, FP32, "nan"),
    "naive_split_fp16_huge": (GATE_UP, SPLIT, FP16, "huge"),
    "sorted_plugin_order_split_slices": (SORTED_PLUGIN, SPLIT_SLICES, FP32, "nan"),
    "naive_gemv_interleaved": (GATE_UP_3D, GEMV_BOTH, FP32, "nan"),
    "sorted_plugin_order_split_interleaved_fp16_huge": (SORTED_PLUGIN_3D, SPLIT, FP16, "huge"),
}


@pytest.mark.parametrize("name", list(ACT_CALLS))
def test_gate_up_expand_fused_into_the_activation(name: str) -> None:
    """SiLU-and-mul on two slices, swigluoai on one interleaved (the `interleaved` calls)."""
    case, config, dtype, poison = ACT_CALLS[name]
    check_expand_activation(case, config, dtype, DEVICE, POISONS[poison])


# (tokens, tiled order or None for the decode GEMVs, add_inputs, dtype, poison); q/k/v-like
# slices of three widths; 70 tokens take two 64-token tiles.
DENSE_CALLS = {
    "gemv": (7, None, True, FP32, "nan"),
    "gemv_overwrite_fp16_huge": (7, None, False, FP16, "huge"),
    "tiled_vllm_order": (70, "vllm", True, FP32, "nan"),
    "tiled_plugin_order_overwrite": (70, "plugin", False, FP32, "nan"),
}


@pytest.mark.parametrize("name", list(DENSE_CALLS))
def test_dense_lora(name: str) -> None:
    tokens, order, add_inputs, dtype, poison = DENSE_CALLS[name]
    check_dense(tokens, 64, 16, [40, 8, 8], 3, dtype, DEVICE, POISONS[poison], order, add_inputs)
