"""Plain-torch spec of the fused MoE-LoRA op: readable, slow, what the Triton kernels are held to.

The op has vLLM 0.26's signature (`vllm/lora/ops/triton_ops/fused_op.py`), so it can take
that op's place. Names used below:

    T  tokens in the batch            k   top_k_num (experts per token)
    P  = T * k routed (token, expert) pairs, a pair's flat id is f = t * k + j
    L  max_loras (adapter slots)      E   experts
    S  slices (2 for gate/up, 1 for down)
    R  max_lora_rank                  K   input features       N   output features per slice

Semantics, for every pair f = (t, j) that carries an active adapter slot l and an expert e >= 0:

    row = f if mul_routed_weight else t                       # which row of x feeds the pair
    for s in range(S):
        delta = (x[row] @ A[s][l, e].T) @ B[s][l, e].T        # (N,): rank-R detour
        if mul_routed_weight: delta *= topk_weights[t, j]
        cols = offset + s * N : offset + (s + 1) * N
        output[t, j, cols] = (output[t, j, cols] if add_inputs else 0) + delta

Pairs that carry no adapter (slot -1, a disabled slot, a slot >= L) or no expert (-1) are left
untouched. Scaling (alpha / rank) is already folded into B by vLLM.

Routing arrives in one of vLLM's two forms:

- naive: `sorted_token_ids is None`; `expert_ids` (P,) holds each pair's expert (topk_ids
  flattened) and `token_lora_mapping` (T,) each token's slot.
- sorted: per slot l, `sorted_token_ids[l]` lists flat pair ids grouped by expert in blocks of
  `block_size` (padding entries are >= P), `expert_ids[l, b]` is block b's expert (-1 unused),
  `num_tokens_post_padded[l]` the used length; only slots in `lora_ids[:num_active_loras]` count.
  `moe_lora_align_reference` builds this form from topk_ids the way vLLM's CUDA op does.
"""

from __future__ import annotations

import torch

from loraplex.kernels.ops.shared import is_active_slot


def pairs_to_update(
    num_pairs: int,
    top_k: int,
    sorted_token_ids: torch.Tensor | None,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor | None,
    token_lora_mapping: torch.Tensor,
    lora_ids: torch.Tensor,
    num_active_loras: int,
    adapter_enabled: torch.Tensor,
    num_slots: int,
    block_size: int,
) -> list[tuple[int, int, int]]:
    """(flat pair id, slot, expert) of every pair the op updates, read off either routing form.

    Every other pair of `output` must be left bit for bit as it was.
    """
    work: list[tuple[int, int, int]] = []
    if sorted_token_ids is None:
        for f in range(num_pairs):
            slot = int(token_lora_mapping[f // top_k])
            expert = int(expert_ids[f])
            if is_active_slot(slot, num_slots, adapter_enabled) and expert >= 0:
                work.append((f, slot, expert))
        return work
    assert num_tokens_post_padded is not None
    for idx in range(num_active_loras):
        slot = int(lora_ids[idx])
        if not is_active_slot(slot, num_slots, adapter_enabled):
            continue
        used = int(num_tokens_post_padded[slot])
        for b in range(min(used, sorted_token_ids.shape[1]) // block_size):
            expert = int(expert_ids[slot, b])
            if expert < 0:
                continue
            for f in sorted_token_ids[slot, b * block_size : (b + 1) * block_size].tolist():
                if f < num_pairs:
                    work.append((int(f), slot, expert))
    return work


def fused_moe_lora_reference(
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
    block_size: int,
    mul_routed_weight: bool = False,
    offset: int = 0,
    add_inputs: bool = True,
) -> None:
    """Apply the op to `output` in place, in float64, as the module docstring states.

    output:               (T, k, C) float, C >= offset + S * N; updated in place
    qcurr_hidden_states:  (T, K), or (P, K) when mul_routed_weight
    lora_a_stacked:       S tensors (L, E, R, K)    lora_b_stacked: S tensors (L, E, N, R)
    topk_weights:         (T, k) float               token_lora_mapping: (T,) int32
    sorted_token_ids:     None or (L, EM) int32      num_tokens_post_padded: None or (L,) int32
    expert_ids:           (P,) or (L, EM // block_size) int32
    lora_ids:             (>= num_active_loras,) int32    num_active_loras: (1,) int32 on the CPU
    adapter_enabled:      (>= L,) int32
    block_size:           the block size the sorted form was aligned to (unused in naive form)
    """
    del max_lora_rank  # the rank is read off the weights; kept for the signature
    num_tokens, top_k, _ = output.shape
    assert top_k == top_k_num
    num_pairs = num_tokens * top_k
    out = output.view(num_pairs, -1)
    x = qcurr_hidden_states.double()
    n_per_slice = lora_b_stacked[0].shape[2]
    work = pairs_to_update(
        num_pairs,
        top_k,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        token_lora_mapping,
        lora_ids,
        int(num_active_loras.reshape(-1)[0]),
        adapter_enabled,
        lora_a_stacked[0].shape[0],
        block_size,
    )
    for f, slot, expert in work:
        row = f if mul_routed_weight else f // top_k
        for s, (a, b) in enumerate(zip(lora_a_stacked, lora_b_stacked, strict=True)):
            delta = (x[row] @ a[slot, expert].double().T) @ b[slot, expert].double().T
            if mul_routed_weight:
                delta = delta * topk_weights.view(-1)[f].double()
            lo = offset + s * n_per_slice
            cols = slice(lo, lo + n_per_slice)
            base = out[f, cols].double() if add_inputs else 0.0
            out[f, cols] = (base + delta).to(out.dtype)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """vLLM's `silu_and_mul` on (rows, 2N): SiLU(gate) * up per element, in float64; the first N
    columns are the gate, the last N the up projection."""
    n = gate_up.shape[1] // 2
    gate, up = gate_up[:, :n].double(), gate_up[:, n:].double()
    return gate * torch.sigmoid(gate) * up


def expand_silu_and_mul_reference(gate_up: torch.Tensor, **op_args: object) -> torch.Tensor:
    """The spec of `act.expand_silu_and_mul`: SiLU-and-mul of the gate/up buffer after
    the op (`fused_moe_lora_reference`) added its LoRA, without changing `gate_up`.

    gate_up: (T, k, 2N), the op's `output`; op_args: the op's other arguments (two slices,
    offset 0, add_inputs, no routing weight). In the sorted form every pair has an expert (no
    expert map). Returns (T * k, N) float64.
    """
    updated = gate_up.double().clone()
    fused_moe_lora_reference(updated, **op_args)  # type: ignore[arg-type]
    return silu_and_mul_reference(updated.view(-1, updated.shape[-1]))


def swigluoai_and_mul_reference(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """vLLM's `swigluoai_and_mul` on (rows, 2N), in float64: gate and up interleaved (gate the
    even columns, up the odd), gate clamped to at most `limit`, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1).

    vLLM's own torch form is `SwigluOAIAndMul.forward_native` (model_executor/layers/
    activation.py, the same in 0.26 and 0.32); it is restated here because `kernels/ops`
    imports only torch and triton, and tests/kernels/ops/moe_lora/test_moe_lora_act.py holds
    this one to vLLM's.
    """
    gate, up = gate_up[:, ::2].double(), gate_up[:, 1::2].double()
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def expand_swigluoai_and_mul_reference(
    gate_up: torch.Tensor, alpha: float, limit: float, **op_args: object
) -> torch.Tensor:
    """The spec of `act.expand_swigluoai_and_mul`: swigluoai of the gate/up buffer after the op
    (`fused_moe_lora_reference`) added its LoRA, without changing `gate_up`.

    gate_up: (T, k, 2N), the op's `output`; op_args: the op's other arguments (one slice of
    2N columns, gate and up interleaved; offset 0, add_inputs, no routing weight). Returns
    (T * k, N) float64.
    """
    updated = gate_up.double().clone()
    fused_moe_lora_reference(updated, **op_args)  # type: ignore[arg-type]
    return swigluoai_and_mul_reference(updated.view(-1, updated.shape[-1]), alpha, limit)
