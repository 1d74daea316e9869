"""The benchmarks' workload builder: each model's calls in vLLM's layout, and how tokens spread
over adapters (pure torch, on CPU)."""

from __future__ import annotations

import pytest
import torch

from bench.kernels.moe_lora_workload import (
    SHAPES,
    CallSpec,
    make_set,
    make_weights,
    token_slots,
)


def test_round_robin_cycles_over_every_adapter() -> None:
    slots = token_slots("round_robin", 10, 4, torch.Generator().manual_seed(0)) % 4
    assert slots.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_one_puts_every_token_on_one_adapter() -> None:
    assert token_slots("one", 7, 8, torch.Generator().manual_seed(0)).unique().tolist() == [0]


def test_zipf_favours_the_first_adapter_in_proportion() -> None:
    slots = token_slots("zipf", 20_000, 8, torch.Generator().manual_seed(0))
    counts = torch.bincount(slots, minlength=8).float()
    # 1 / (i + 1) normalised over 8 adapters: slot 0 gets 0.368, slot 7 0.046.
    assert counts[0] / counts.sum() == pytest.approx(0.368, abs=0.01)
    assert counts[7] / counts.sum() == pytest.approx(0.046, abs=0.01)


def test_unknown_popularity_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"popularity must be one of .*'round_robin'.*got 'hot'"):
        token_slots("hot", 4, 2, torch.Generator())  # type: ignore[arg-type]


def test_one_adapter_reads_fewer_bytes_and_keeps_the_routing() -> None:
    """Popularity changes the slots only: same experts per token, and the floor (distinct
    (slot, expert) bytes) shrinks when every token uses one adapter."""
    shape = SHAPES["gpt-oss-20b"]
    spec = CallSpec.of(shape, "w2")
    weights = make_weights(shape, spec, 8, 8, torch.float32, "cpu")
    sets = {
        pop: make_set(
            shape, spec, 32, 8, 1, weights, 16, torch.float32, "cpu", naive=True, popularity=pop
        )
        for pop in ("round_robin", "zipf", "one")
    }
    (rr_args, rr_bytes), (one_args, one_bytes) = sets["round_robin"], sets["one"]
    for args, _ in sets.values():
        assert torch.equal(args["expert_ids"], rr_args["expert_ids"])
        assert torch.equal(args["qcurr_hidden_states"], rr_args["qcurr_hidden_states"])
    assert one_args["token_lora_mapping"].unique().tolist() == [1]  # rotated by the set index
    assert one_bytes < rr_bytes


def test_gate_up_is_one_slice_of_both_halves_in_the_3d_layout_and_two_otherwise() -> None:
    """vLLM 0.26 serves GPT-OSS with FusedMoE3DWithLoRA: gate/up is one A and one B of
    2 x inter rows; Qwen3 with FusedMoEWithLoRA: a gate and an up slice of inter rows each.
    Down is one slice in both."""
    gpt_oss, qwen3 = SHAPES["gpt-oss-20b"], SHAPES["qwen3-30b-a3b"]
    assert (gpt_oss.layout, qwen3.layout) == ("3d", "2d")
    assert CallSpec.of(gpt_oss, "w13") == CallSpec("w13", 2880, 2 * 2880, 1, False)
    assert CallSpec.of(qwen3, "w13") == CallSpec("w13", 2048, 768, 2, False)
    assert CallSpec.of(gpt_oss, "w2") == CallSpec("w2", 2880, 2880, 1, True)
    assert CallSpec.of(qwen3, "w2") == CallSpec("w2", 768, 2048, 1, True)


@pytest.mark.parametrize(
    ("name", "a_shapes", "b_shapes"),
    [
        # FusedMoE3DWithLoRA's w13 buffers: (L, E, R, hidden) and (L, E, 2 x inter, R), one each
        ("gpt-oss-20b", [(2, 32, 8, 2880)], [(2, 32, 5760, 8)]),
        # FusedMoEWithLoRA's: a gate and an up of (L, E, R, hidden) and (L, E, inter, R)
        ("qwen3-30b-a3b", [(2, 128, 8, 2048)] * 2, [(2, 128, 768, 8)] * 2),
    ],
)
def test_gate_up_weights_and_call_are_vllms_buffers_for_the_layout(
    name: str, a_shapes: list[tuple[int, ...]], b_shapes: list[tuple[int, ...]]
) -> None:
    """The weights are vLLM's stacked buffers for the model's layout; the call writes the whole
    gate/up output (2 x inter columns) from x of hidden columns, and its floor counts every A and
    B a routed (slot, expert) holds: one A in the 3D layout, two in the 2D."""
    shape = SHAPES[name]
    spec = CallSpec.of(shape, "w13")
    a, b = make_weights(shape, spec, 2, 8, torch.float32, "cpu")
    assert [tuple(t.shape) for t in a] == a_shapes
    assert [tuple(t.shape) for t in b] == b_shapes
    args, nbytes = make_set(shape, spec, 4, 2, 0, (a, b), 16, torch.float32, "cpu", naive=True)
    assert args["output"].shape == (4, shape.top_k, 2 * shape.inter)
    assert args["qcurr_hidden_states"].shape == (4, shape.hidden)
    distinct = torch.unique(
        args["token_lora_mapping"].long().repeat_interleave(shape.top_k) * shape.experts
        + args["expert_ids"].long()
    ).numel()
    per_pair = 4 * sum(r * k for _, _, r, k in a_shapes) + 4 * sum(n * r for _, _, n, r in b_shapes)
    assert nbytes == distinct * per_pair
