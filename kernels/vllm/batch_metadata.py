"""vLLM 0.26's `PunicaWrapperGPU.update_metadata`, built on the host: no device sync per step.

Each engine step vLLM turns the batch's LoRA mapping (a tuple of adapter ids per token, made on
the host) into index tensors: `convert_mapping` (a Python loop over the tokens, then
`torch.tensor` of lists of numpy scalars) and `LoRAKernelMeta.prepare_tensors` (tokens sorted by
slot, the active slots and their counts). The latter runs on the device copy of the mapping,
and its `if torch.all(...)` and `torch.unique` wait for the device. With vLLM's async
scheduling the host prepares step N+1 while step N runs, so that wait holds the host until step
N is done, and the rest of step N+1's preparation then runs with the GPU idle.

Measured on the H200 (bench_e2e.py --profile host, 16 x 1600-token prefill, engine in
process): `update_metadata` took 190 ms of the 502 ms prefill by py-spy's samples, 131 ms of
it waiting in `prepare_tensors`.

Here the same tensors come from numpy on the host (the mapping's own home) and go to the
device by pinned, non-blocking copies. Same values, `np.argsort(kind="stable")` ordering ties as
the stable `torch.sort` does, with two changes: the no-adapter id -1 sorts after the adapters
and is not counted among them, and a step without adapters still writes its mapping
(`fill_kernel_meta`). tests/kernels/vllm/test_batch_metadata.py holds this to vLLM's own
`prepare_tensors`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def slots_of(lora_ids: Sequence[int], lora_index_to_id: Sequence[int | None]) -> np.ndarray:
    """Each entry's LoRA slot, -1 where its id is not positive (no adapter), as int64."""
    ids = np.fromiter(lora_ids, dtype=np.int64, count=len(lora_ids))
    slots = np.full(ids.shape, -1, dtype=np.int64)
    for slot, lora_id in enumerate(lora_index_to_id):
        if lora_id is not None and lora_id > 0:
            slots[ids == lora_id] = slot
    unknown = (ids > 0) & (slots < 0)
    if unknown.any():  # vLLM's dict lookup raises KeyError here too
        raise KeyError(f"LoRA id {int(ids[unknown][0])} is in the batch but in no slot")
    return slots


def _to_device(dst: torch.Tensor, array: np.ndarray) -> None:
    """dst[:len(array)] = array, without waiting for the device when dst is on one."""
    src = torch.from_numpy(np.ascontiguousarray(array)).to(dst.dtype)
    if dst.is_cuda:
        src = src.pin_memory()  # a pageable source would make the copy wait for the stream
    dst[: src.shape[0]].copy_(src, non_blocking=True)


def fill_kernel_meta(meta: Any, slots: np.ndarray) -> None:
    """`LoRAKernelMeta.prepare_tensors(slots)` computed on the host, where the tokens without an
    adapter (slot -1) and their id come after the adapters', and the count holds the adapters
    alone.

    The kernels, vLLM's and ours, walk the first `num_active_loras` entries of
    `active_lora_ids`. vLLM 0.26 sorts -1 first and counts it, while under its
    specialize_active_lora it picks the CUDA graph by the batch's adapters alone (rounded up to
    a captured count): a batch of one adapter beside base-model requests replays the graph of
    one, whose kernels then walk -1 only and drop the adapter's delta (seen on the H200,
    kernels/dispatch.py). With -1 last and uncounted, the first entries are the
    adapters in every mode; tokens without one need no kernel. Without that setting the kernels
    walk all max_loras + 1 entries, in whatever order.

    `token_lora_mapping` is written on every step, also on one without adapters, where vLLM
    leaves the previous step's mapping in place: vLLM's kernels walk `active_lora_ids` (reset to
    -1 every step), ours read each token's slot from the mapping (the naive MoE form, the dense
    GEMVs, `moe_lora_sum`), so a kernel of ours that still ran on such a step (a CUDA graph
    captured with adapters) gave a base-model token the adapter its position held a step earlier.
    """
    meta._reset()
    _to_device(meta.token_lora_mapping, slots)
    no_lora = bool((slots == -1).all())
    meta.no_lora_flag_cpu[0] = no_lora
    if no_lora:
        return
    last = np.iinfo(np.int64).max  # the sort key of "no adapter": after every slot
    # In int64 whatever the mapping's dtype: numpy 2 keeps an int32 array's dtype, where `last`
    # overflows (vLLM's token_lora_mapping is int32 on the device).
    keys = np.where(slots < 0, last, slots.astype(np.int64, copy=False))
    _to_device(meta.token_indices_sorted_by_lora_ids, np.argsort(keys, kind="stable"))
    sorted_keys, counts = np.unique(keys, return_counts=True)
    _to_device(meta.active_lora_ids, np.where(sorted_keys == last, -1, sorted_keys))
    _to_device(meta.num_tokens_per_lora, counts)
    active = int((sorted_keys != last).sum())
    captured = meta.captured_lora_counts  # cudagraph keys: the count rounds up to one of them
    if captured and (at := bisect.bisect_left(captured, active)) < len(captured):
        active = captured[at]
    meta.num_active_loras_cpu[0] = active
    _to_device(meta.lora_token_start_loc[1:], np.cumsum(counts))


def update_metadata(
    self: Any,
    mapping: Any,
    lora_index_to_id: list[int | None],
    max_loras: int,
    vocab_size: int,
    **kwargs: Any,
) -> None:
    """PunicaWrapperGPU.update_metadata of vLLM 0.26 (its `_update_base_metadata` with
    `convert_mapping`, then both kernel metas), every value computed on the host."""
    self.is_prefill = mapping.is_prefill
    tokens = slots_of(mapping.index_mapping, lora_index_to_id)
    prompts = slots_of(mapping.prompt_mapping, lora_index_to_id)
    # convert_mapping's outputs: embeddings rows are (slot * extra vocab = 0, slot * vocab),
    # slot 0 for tokens without adapter (so never -1: its `where(== -1, max_loras - 1)` cannot
    # fire); padded sampler rows index a (rows x max_loras) table.
    embeddings = np.stack([np.zeros_like(tokens), np.maximum(tokens, 0) * vocab_size])
    padded = np.where(prompts == -1, max_loras - 1, prompts)
    padded = np.arange(len(padded), dtype=np.int64) + padded * len(padded)
    _to_device(self._token_lora_indices, tokens)
    _to_device(self._sampler_indices, prompts)
    _to_device(self._sampler_indices_padded, padded)
    for row in range(2):
        _to_device(self._embeddings_indices[row], embeddings[row])
    self.indices_len[:] = [len(tokens), len(prompts), len(padded), len(tokens)]
    fill_kernel_meta(self.token_mapping_meta, tokens)
    fill_kernel_meta(self.prompt_mapping_meta, prompts)
