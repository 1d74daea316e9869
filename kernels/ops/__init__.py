"""Our LoRA ops, one folder each, in four parts: the `@triton.jit` bodies (`kernels.py`), the
launcher that checks shapes, allocates and launches (`op.py`), the plain-torch spec the tests
hold them to (`reference.py`), and for the MoE-LoRA op the tuned launch configs (`configs.py`,
reading `kernels/configs/`).

- `moe_lora`: vLLM 0.26's `fused_moe_lora` (x @ A.T @ B.T per routed (token, expert) pair), its
  decode GEMVs and its gate/up expand fused into SiLU-and-mul (`act.py`);
- `moe_lora_align`: the sorted routing form, as vLLM's `moe_lora_align_block_size` builds it;
- `moe_lora_sum`: vLLM's moe_sum with the down LoRA's delta added in the same pass;
- `lora_dense`: vLLM's `add_lora_linear` (attention), GEMVs for decode, tiles for prefill.

Files here import torch, triton and each other only (tests/kernels/test_layering.py checks it);
Triton helpers that kernels of more than one file call live in `shared.py`. Which form serves a
call is `kernels/dispatch.py`'s.
"""
