"""Our ops' registration as torch ops with vLLM's schemas."""

from __future__ import annotations


def test_ops_dispatch_straight_to_our_functions_with_vllms_mutation_schema() -> None:
    """The three ops are registered as vLLM registers its own: a CUDA kernel and a fake, no
    torch.library.custom_op layers (their per-call Python cost is what the change removed), and
    the arguments vLLM's callers expect written in place are marked so in the schema."""
    import torch
    from torch._library.custom_ops import _maybe_get_opdef

    from loraplex.kernels.vllm import custom_ops

    ops = {
        "fused_moe_lora": (custom_ops.define_moe_lora_op(lambda *args: None), {"output"}),
        "lora_linear": (custom_ops.define_dense_op(lambda *args: None, lambda *args: None), {"y"}),
        "moe_lora_align_block_size": (
            custom_ops.define_align_op(lambda *args: None),
            {"sorted_token_ids", "experts_ids", "num_tokens_post_pad"},
        ),
    }
    defined_again = custom_ops.define_moe_lora_op(lambda *args: None)
    assert defined_again is ops["fused_moe_lora"][0]  # defined once
    for name, (op, mutated) in ops.items():
        qualified = f"loraplex::{name}"
        assert op._qualified_op_name == qualified
        assert _maybe_get_opdef(qualified) is None
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Meta")  # the fake
        written = {
            a.name for a in op.default._schema.arguments if a.alias_info and a.alias_info.is_write
        }
        assert written == mutated
