"""Dense (attention) LoRA: `op.lora_dense` for decode, `tiled.lora_dense_tiled` for prefill,
spec in `reference`."""
