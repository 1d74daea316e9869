"""vLLM 0.26's `PunicaWrapperGPU` methods that route LoRA calls to our kernels' best forms.

- `add_lora_linear` (attention and other dense layers): one call of our op
  `torch.ops.loraplex.lora_linear` (`custom_ops.define_dense_op`).
- `moe_lora_align_block_size`, wrapped by `routing_for_our_kernels`: asks vLLM's align for the
  routing form our MoE-LoRA kernels are fastest in (`REGIMES.naive`, `REGIMES.block_m`).
- `add_lora_fused_moe`, wrapped by `configs_at_aligned_block`: the kernels read the sorted ids
  in blocks of the size they were aligned to.

The ops' modules are imported inside the wrappers, not here (see `custom_ops`).
"""

import functools
from collections.abc import Callable
from typing import Any

import torch

from loraplex.kernels.dispatch import REGIMES

# On the PunicaWrapperGPU: (address of the sorted ids, block) of the routing its wrapped align last
# built at another block size than vLLM's config asked for, else None; read back by the wrapped
# add_lora_fused_moe. By address, not an attribute on the tensor: both calls of a layer get views
# of it, and under inference mode (vLLM's forward) a view keeps no link to the tensor it views.
ALIGNED_ATTR = "_loraplex_aligned"


def add_lora_linear(
    self: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: tuple[torch.Tensor, ...],
    lora_b_stacked: tuple[torch.Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    *,
    buffer: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """PunicaWrapperGPU.add_lora_linear (vLLM 0.26 semantics) through torch.ops.loraplex."""
    del output_slices, buffer  # widths come from B's shapes, as in vLLM's expand; no buffer
    x2 = x.view(-1, x.shape[-1])
    meta = self.token_mapping_meta.meta_args(x2.size(0), self.lora_config.specialize_active_lora)
    torch.ops.loraplex.lora_linear(
        y.view(-1, y.shape[-1]), x2, list(lora_a_stacked), list(lora_b_stacked), float(scale),
        *meta, bool(kwargs.get("add_inputs", True)),
    )  # fmt: skip


def routing_for_our_kernels(align: Callable[..., Any]) -> Callable[..., Any]:
    """PunicaWrapperGPU.moe_lora_align_block_size that asks for the routing form our kernels are
    fastest in: the naive form (no align kernel, one program per pair) where vLLM would sort
    (`REGIMES.naive`), and in the sorted form smaller blocks than vLLM's config
    (`REGIMES.block_m`; the wrapper remembers the block, ALIGNED_ATTR, for
    `configs_at_aligned_block`). Both stay vLLM's under expert parallelism (expert_map: vLLM's
    naive form has no map from global to local experts), with fully sharded LoRA or ranks over
    MAX_RANK (our op declines those calls, and vLLM's kernel was not timed in our forms)."""
    from loraplex.kernels.ops.moe_lora.op import MAX_RANK

    @functools.wraps(align)
    def moe_lora_align_block_size(
        self: Any,
        topk_ids: torch.Tensor,
        num_tokens: int,
        block_size: int,
        num_experts: int,
        max_loras: int,
        adapter_enabled: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        pad_sorted_ids: bool = False,
        naive_block_assignment: bool = False,
        token_lora_mapping: torch.Tensor | None = None,
    ) -> Any:
        config = self.lora_config
        ours = not config.fully_sharded_loras and config.max_lora_rank <= MAX_RANK
        vllm_block = block_size
        if expert_map is None and ours:
            pairs = topk_ids.numel()
            naive_block_assignment = REGIMES.naive(
                pairs, num_experts, max_loras, naive_block_assignment, _active_loras(self)
            )
            block_size = REGIMES.block_m(pairs, num_experts, max_loras, block_size)
        routing = align(self, topk_ids, num_tokens, block_size, num_experts, max_loras,
                        adapter_enabled, expert_map, pad_sorted_ids, naive_block_assignment,
                        token_lora_mapping)  # fmt: skip
        sorted_ids = routing[1]
        changed = sorted_ids is not None and block_size != vllm_block
        setattr(self, ALIGNED_ATTR, (sorted_ids.data_ptr(), block_size) if changed else None)
        return routing

    return moe_lora_align_block_size


def _active_loras(punica: Any) -> int | None:
    """How many adapters the batch being routed holds, where vLLM captures a CUDA graph per
    count (specialize_active_lora: the count is then rounded up to the graph's, and
    `batch_metadata.fill_kernel_meta` counts adapters only); else None. Without that setting a
    graph replays the form chosen at its capture for every count, and vLLM rounds every count
    up to max_loras + 1 anyway."""
    if not punica.lora_config.specialize_active_lora:
        return None
    count = int(punica.token_mapping_meta.num_active_loras_cpu[0])
    return count if count > 0 else None


def aligned_block(punica: Any, sorted_token_ids: torch.Tensor | None) -> int | None:
    """The block size `routing_for_our_kernels` last aligned routing to on this wrapper, where
    it was not vLLM's and these sorted ids (or a view of them) are that routing; else None."""
    aligned = getattr(punica, ALIGNED_ATTR, None)
    if sorted_token_ids is None or aligned is None:
        return None
    address, block = aligned
    return int(block) if sorted_token_ids.data_ptr() == address else None


def configs_at_aligned_block(add_lora_fused_moe: Callable[..., Any]) -> Callable[..., Any]:
    """PunicaWrapperGPU.add_lora_fused_moe (gate/up and down) with BLOCK_SIZE_M of both configs
    set to the block the routing was aligned to, where `routing_for_our_kernels` chose it:
    the kernels, ours or vLLM's, read the sorted ids in blocks of that size."""

    @functools.wraps(add_lora_fused_moe)
    def add(
        self: Any,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        topk_weights: torch.Tensor,
        sorted_token_ids: torch.Tensor | None,
        expert_ids: torch.Tensor,
        num_tokens_post_padded: torch.Tensor | None,
        max_lora_rank: int,
        top_k_num: int,
        shrink_config: dict[str, Any],
        expand_config: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        block = aligned_block(self, sorted_token_ids)
        if block is not None:
            shrink_config = {**shrink_config, "BLOCK_SIZE_M": block}
            expand_config = {**expand_config, "BLOCK_SIZE_M": block}
        return add_lora_fused_moe(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights,
                                  sorted_token_ids, expert_ids, num_tokens_post_padded,
                                  max_lora_rank, top_k_num, shrink_config, expand_config, *args,
                                  **kwargs)  # fmt: skip

    return add
