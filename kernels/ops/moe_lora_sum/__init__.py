"""vLLM's moe_sum with the down LoRA's delta: `op.moe_sum_with_delta`, spec in `reference`."""
