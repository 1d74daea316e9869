"""Plain-torch spec of the dense LoRA ops (`op.lora_dense`, `tiled.lora_dense_tiled`; the
semantics are in `op`'s docstring), and the batch metadata the tiled op takes, built as vLLM
builds it."""

from __future__ import annotations

import torch


def lora_dense_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    token_lora_mapping: torch.Tensor,
    scale: float = 1.0,
    add_inputs: bool = True,
) -> None:
    """The spec in plain torch (float64, with the shrink rounded to the weights' dtype)."""
    col = 0
    for a, b in zip(lora_a, lora_b, strict=True):
        n = b.shape[2]
        for t, slot in enumerate(token_lora_mapping.tolist()):
            if not 0 <= slot < a.shape[0]:
                continue
            mid = (scale * (x[t].double() @ a[slot, 0].double().T)).to(b.dtype).double()
            delta = mid @ b[slot, 0].double().T
            base = y[t, col : col + n].double() if add_inputs else 0.0
            y[t, col : col + n] = (base + delta).to(y.dtype)
        col += n


def lora_sort_meta(
    token_lora_mapping: torch.Tensor, max_loras: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids)
    as `LoRAKernelMeta.prepare_tensors` writes them: a stable sort by slot, then per distinct
    slot (ascending, -1 first if present) its count and start; unused entries -1 / 0."""
    dev = token_lora_mapping.device
    order = torch.sort(token_lora_mapping, stable=True).indices.to(torch.int32)
    ids, counts = torch.unique(token_lora_mapping, sorted=True, return_counts=True)
    lora_ids = torch.full((max_loras + 1,), -1, dtype=torch.int32, device=dev)
    num_per_lora = torch.zeros(max_loras + 1, dtype=torch.int32, device=dev)
    start_loc = torch.zeros(max_loras + 2, dtype=torch.int32, device=dev)
    lora_ids[: ids.numel()] = ids.to(torch.int32)
    num_per_lora[: counts.numel()] = counts.to(torch.int32)
    start_loc[1 : counts.numel() + 1] = torch.cumsum(counts, 0).to(torch.int32)
    return order, num_per_lora, start_loc, lora_ids
