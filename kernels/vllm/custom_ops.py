"""Our three ops as torch ops with vLLM 0.26's schemas, each falling back to vLLM's own where ours
does not serve: `torch.ops.loraplex.fused_moe_lora`, `lora_linear` and
`moe_lora_align_block_size`. `plugin.register()` points vLLM at them.

The ops' modules are imported only when an op is defined: importing this module (as the server
does, through the plugin) must not create Triton kernels, which pick compiled or interpreted mode
at creation.
"""

from collections.abc import Callable
from typing import Any

import torch

from loraplex.kernels.dispatch import REGIMES

OP_NAME = "loraplex::fused_moe_lora"
DENSE_OP_NAME = "loraplex::lora_linear"
ALIGN_OP_NAME = "loraplex::moe_lora_align_block_size"

_LIBRARY: list[Any] = []  # the torch.library.Library our ops live in, kept alive with the process


def _register_op(qualified: str, fn: Callable[..., None], mutates_args: tuple[str, ...]) -> Any:
    """The op `qualified` ("loraplex::name") with `fn`'s schema, dispatched straight to `fn` on
    CUDA, and a no-op fake for torch.compile; vLLM registers its own ops so too
    (`direct_register_custom_op`).

    Not torch.library.custom_op: each call of one goes through Python dispatch layers (an
    ADInplaceOrView kernel, a dynamo-disabled wrapper, alias checks), and a prefill of 16 x 1600
    tokens makes 480 calls of our three ops; on the H200 those layers were the host's largest
    self time under cProfile (docs/kernels.md, "Op registration")."""
    name = qualified.split("::")[1]
    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library("loraplex", "FRAGMENT"))
    library = _LIBRARY[0]
    library.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
    library.impl(name, fn, "CUDA")
    library._register_fake(name, lambda *args, **kwargs: None)
    return getattr(torch.ops.loraplex, name)


def define_moe_lora_op(original: Callable[..., None]) -> Any:
    """torch.ops.loraplex.fused_moe_lora with vLLM 0.26's schema; `original` is vLLM's eager
    implementation, used for the calls ours does not cover. Defined once per process."""
    if hasattr(torch.ops.loraplex, "fused_moe_lora"):
        return torch.ops.loraplex.fused_moe_lora
    from loraplex.kernels.ops.moe_lora.op import (
        UnsupportedMoeLoraCall,
        before_output_write,
        fused_moe_lora,
    )

    def op(
        output: torch.Tensor,
        qcurr_hidden_states: torch.Tensor,
        lora_a_stacked: list[torch.Tensor],
        lora_b_stacked: list[torch.Tensor],
        topk_weights: torch.Tensor,
        sorted_token_ids: torch.Tensor | None,
        expert_ids: torch.Tensor,
        num_tokens_post_padded: torch.Tensor | None,
        token_lora_mapping: torch.Tensor,
        max_lora_rank: int,
        top_k_num: int,
        lora_ids: torch.Tensor,
        num_active_loras: torch.Tensor,
        adapter_enabled: torch.Tensor,
        shrink_block_size_m: int,
        shrink_block_size_n: int,
        shrink_block_size_k: int,
        shrink_group_size_m: int,
        shrink_num_warps: int,
        shrink_num_stages: int,
        shrink_split_k: int,
        expand_block_size_m: int,
        expand_block_size_n: int,
        expand_block_size_k: int,
        expand_group_size_m: int,
        expand_num_warps: int,
        expand_num_stages: int,
        expand_split_k: int,
        mul_routed_weight: bool = False,
        fully_sharded: bool = False,
        offset: int = 0,
        add_inputs: bool = True,
    ) -> None:
        args = (
            output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights,
            sorted_token_ids, expert_ids, num_tokens_post_padded, token_lora_mapping,
            max_lora_rank, top_k_num, lora_ids, num_active_loras, adapter_enabled,
            shrink_block_size_m, shrink_block_size_n, shrink_block_size_k, shrink_group_size_m,
            shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m,
            expand_block_size_n, expand_block_size_k, expand_group_size_m, expand_num_warps,
            expand_num_stages, expand_split_k, mul_routed_weight, fully_sharded, offset,
            add_inputs,
        )  # fmt: skip
        try:
            fused_moe_lora(*args)
        except UnsupportedMoeLoraCall:
            before_output_write()
            original(*args)

    return _register_op(OP_NAME, op, mutates_args=("output",))


def define_dense_op(shrink: Callable[..., None], expand: Callable[..., None]) -> Any:
    """torch.ops.loraplex.lora_linear: `PunicaWrapperGPU.add_lora_linear`'s work as one op: our
    per-token kernel for decode batches (`REGIMES.dense_gemv`), our tiled ones for prefill
    batches, vLLM's `shrink` and `expand` (its eager implementations) for layouts ours do not
    take. The LoRA runs after its base GEMM, on the main stream: beside the GEMM it lost, at
    prefill and at decode (docs/kernels.md, "Dense LoRA beside the GEMM")."""
    if hasattr(torch.ops.loraplex, "lora_linear"):
        return torch.ops.loraplex.lora_linear
    from loraplex.kernels.ops.lora_dense.op import UnsupportedDenseCall, lora_dense
    from loraplex.kernels.ops.lora_dense.tiled import lora_dense_tiled

    def op(
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
        scale: float,
        token_lora_mapping: torch.Tensor,
        token_indices_sorted_by_lora_ids: torch.Tensor,
        num_tokens_per_lora: torch.Tensor,
        lora_token_start_loc: torch.Tensor,
        lora_ids: torch.Tensor,
        no_lora_flag_cpu: torch.Tensor,
        num_active_loras: torch.Tensor,
        add_inputs: bool,
    ) -> None:
        if bool(no_lora_flag_cpu.item()):  # a CPU tensor by vLLM's contract: no device sync
            return
        try:
            if REGIMES.dense_gemv(x.shape[0]):
                lora_dense(y, x, lora_a, lora_b, token_lora_mapping, scale, add_inputs)
            else:
                lora_dense_tiled(
                    y, x, lora_a, lora_b, scale, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, add_inputs,
                )  # fmt: skip
            return
        except UnsupportedDenseCall:
            pass
        meta = (token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras)  # fmt: skip
        rank = lora_b[0].shape[-1]
        buffer = torch.empty((len(lora_a), x.shape[0], rank), dtype=torch.float32, device=x.device)
        shrink(x, lora_a, buffer, *meta, scale)
        expand(buffer, lora_b, y, *meta, offset_start=0, add_inputs=add_inputs)

    return _register_op(DENSE_OP_NAME, op, mutates_args=("y",))


def define_align_op(original: Callable[..., None]) -> Any:
    """torch.ops.loraplex.moe_lora_align_block_size with the schema of vLLM 0.26's
    `_custom_ops.moe_lora_align_block_size`: ours where `REGIMES.our_align` says so, `original`
    (vLLM's) for smaller batches and under expert parallelism (an expert map)."""
    if hasattr(torch.ops.loraplex, "moe_lora_align_block_size"):
        return torch.ops.loraplex.moe_lora_align_block_size
    from loraplex.kernels.ops.moe_lora_align.op import BLOCK_SIZES, moe_lora_align_block_size

    def op(
        topk_ids: torch.Tensor,
        token_lora_mapping: torch.Tensor,
        num_experts: int,
        block_size: int,
        max_loras: int,
        max_num_tokens_padded: int,
        max_num_m_blocks: int,
        sorted_token_ids: torch.Tensor,
        experts_ids: torch.Tensor,
        num_tokens_post_pad: torch.Tensor,
        adapter_enabled: torch.Tensor,
        lora_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
    ) -> None:
        ours = (expert_map is None and block_size in BLOCK_SIZES
                and REGIMES.our_align(topk_ids.numel()))  # fmt: skip
        if ours:
            moe_lora_align_block_size(
                topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                num_tokens_post_pad, adapter_enabled,
            )  # fmt: skip
            return
        original(topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                 max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                 num_tokens_post_pad, adapter_enabled, lora_ids, expert_map)  # fmt: skip

    mutated = ("sorted_token_ids", "experts_ids", "num_tokens_post_pad")
    return _register_op(ALIGN_OP_NAME, op, mutates_args=mutated)
