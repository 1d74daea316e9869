"""The sorted routing form of the MoE-LoRA op: `op.moe_lora_align_block_size`, spec in
`reference`."""
