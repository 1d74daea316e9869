"""The MoE-LoRA op (vLLM 0.26's `fused_moe_lora`): `op.fused_moe_lora`, spec in `reference`."""
