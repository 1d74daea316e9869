"""Triton kernels for LoRA on Mixture-of-Experts and dense layers, and the vLLM plugin that
serves vLLM's LoRA calls with them on GPUs.

- `ops/`: the ops, one folder each (kernels, launcher, plain-torch reference), importing only
  torch and triton: `moe_lora` (vLLM's `fused_moe_lora`), `moe_lora_align` (its sorted routing
  form), `moe_lora_sum` (moe_sum with the down LoRA's delta), `lora_dense` (`add_lora_linear`).
- `dispatch.py`: which form of them serves a call, by batch size (one table, `REGIMES`).
- `configs/`: the MoE-LoRA op's tuned launch configs per GPU, as data
  (`ops/moe_lora/configs.py` reads them; `bench/kernels/tune_moe_lora.py` writes them).
- `vllm/`: everything that touches vLLM: `plugin.register()` (the `vllm.general_plugins` entry
  point; switched off by LORAPLEX_ENGINE__MOE_LORA_KERNELS=0) and its patches, listed with why
  in that package's docstring.

Importing this package imports nothing heavy; the plugin imports vLLM and the ops inside
`register()`. docs/kernels.md holds the decisions and the measurements behind them.
"""
