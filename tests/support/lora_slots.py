"""A vLLM worker extension for tests: what the LoRA slots of a running engine hold.

Named in `worker_extension_cls` ("tests.support.lora_slots.SlotProbe"), vLLM mixes it into its
worker class; the test calls its methods through `AsyncLLM.collective_rpc`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

# vLLM 0.26's FusedMoEWithLoRA also keeps `lora_a_stacked`/`lora_b_stacked`: flat lists of
# views into its w13_/w2_ buffers, one per (slot, expert), for dummy adapters. They are not
# indexed by slot (indexing them by one counted every slot's values: 176,128 "non-zero" values in
# a freed slot on the H200), and the buffers they view are read already.
MOE_VIEW_LISTS = ("lora_a_stacked", "lora_b_stacked")


def stacked_tensors(layer: Any) -> Iterator[torch.Tensor]:
    """Every per-slot weight buffer of a vLLM LoRA layer: its `*_stacked` attributes (a tensor,
    or a tuple or list of them), each indexed by slot first."""
    moe = hasattr(layer, "w13_lora_a_stacked")
    for name, value in vars(layer).items():
        if not name.endswith("_stacked") or (moe and name in MOE_VIEW_LISTS):
            continue
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor):
                yield tensor


class SlotProbe:
    """Mixed into vLLM's worker, so `self` is the worker."""

    model_runner: Any

    def lora_slots(self) -> list[dict[str, Any]]:
        """Per slot of the worker's LoRAModelManager: the adapter id in it (None: free), and how
        many of its values, over every LoRA layer, are not zero and not finite."""
        manager = self.model_runner.lora_manager._adapter_manager
        slots = []
        for index, lora_id in enumerate(manager.lora_index_to_id):
            nonzero = non_finite = 0
            for layer in manager.modules.values():
                for tensor in stacked_tensors(layer):
                    values = tensor[index]
                    nonzero += int(values.count_nonzero())
                    non_finite += int((~values.isfinite()).sum())
            slots.append({"id": lora_id, "nonzero": nonzero, "non_finite": non_finite})
        return slots

    def lora_slot_ids(self) -> list[int | None]:
        """The adapter id in each slot of the worker's LoRAModelManager (None: free)."""
        return list(self.model_runner.lora_manager._adapter_manager.lora_index_to_id)

    def slot_zeroing_installed(self) -> bool:
        """Whether this process's LoRAModelManager carries lora_slot_hygiene's patch."""
        from vllm.lora.model_manager import LoRAModelManager

        from loraplex.kernels.vllm.lora_slot_hygiene import PATCHED

        return bool(getattr(LoRAModelManager._deactivate_adapter, PATCHED, False))

    def loraplex_kernels_serve(self) -> bool:
        """Whether vLLM's PunicaWrapperGPU in this process calls loraplex's dense LoRA (the
        plugin's kernels serve) rather than its own (handed back, or never patched)."""
        from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

        from loraplex.kernels.vllm.punica import add_lora_linear

        return vars(PunicaWrapperGPU).get("add_lora_linear") is add_lora_linear
