"""Triton kernels for LoRA on Mixture-of-Experts layers, with torch references and a vLLM plugin.

- `moe_lora_op.fused_moe_lora`: vLLM 0.26's `fused_moe_lora` signature, our kernels
  (`moe_lora_triton`; for decode's one-pair units also `moe_lora_gemv_triton`), spec in
  `moe_lora_reference`, tuned configs in `configs/` read by
  `moe_lora_configs` and written by `tune_moe_lora` (or `bench/kernels/bench_moe_lora.py --tune`).
- `lora_dense_op.lora_dense`: dense (attention) LoRA for decode batches, kernels in
  `lora_dense_triton`, spec beside it; `lora_dense_tiled.lora_dense_tiled`: the same for prefill
  batches, tiled by adapter (kernels in `lora_dense_tiled_triton`).
- `moe_lora_align.moe_lora_align_block_size`: the MoE-LoRA sorted routing form, as vLLM's CUDA
  op builds it (spec `moe_lora_reference.moe_lora_align_reference`), for large batches.
- `moe_act_fusion`, `moe_lora_side_stream`, `moe_lora_sum`: the plugin's changes to vLLM's fused
  experts (gate/up LoRA inside SiLU-and-mul; at prefill and in CUDA graphs the MoE LoRA on a side
  stream beside the base GEMMs, the down LoRA's delta summed by moe_sum).
- `plugin.register()`: the `vllm.general_plugins` entry point; switched off by
  LORAPLEX_ENGINE__MOE_LORA_KERNELS=0.

Importing this package imports nothing heavy; the modules import only torch and triton (the
plugin imports vLLM inside `register()`).
"""
