"""Plain-torch spec of `op.moe_sum_with_delta`."""

from __future__ import annotations

import torch

from loraplex.kernels.ops.shared import is_active_slot


def moe_sum_with_delta_reference(
    experts_out: torch.Tensor,
    delta: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    adapter_enabled: torch.Tensor,
    max_loras: int,
) -> torch.Tensor:
    """The spec of `op.moe_sum_with_delta`: vLLM's moe_sum (each token's k expert
    outputs summed) of experts_out + delta, where a token's delta rows count only if it carries
    an active slot (the pairs the op writes with add_inputs=False; the other rows of delta may
    hold anything).

    experts_out, delta: (T, k, H); token_lora_mapping: (>= T,) slot per token; adapter_enabled:
    (> max_loras,). Returns (T, H) float64.
    """
    total = experts_out.double().sum(dim=1)
    for t in range(experts_out.shape[0]):
        if is_active_slot(int(token_lora_mapping[t]), max_loras, adapter_enabled):
            total[t] += delta[t].double().sum(dim=0)
    return total
