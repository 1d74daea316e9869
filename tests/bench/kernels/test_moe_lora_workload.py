"""The benchmarks' workload builder: how tokens spread over adapters (pure torch, on CPU)."""

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
