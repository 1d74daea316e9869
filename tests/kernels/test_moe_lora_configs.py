"""The tuned-config file: a tuner run over some batches merges into what is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.kernels import moe_lora_configs as configs
from loraplex.kernels.moe_lora_configs import MoeLoraConfig, ShapeKey


def test_partial_tuning_keeps_other_pair_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    key = ShapeKey(2048, 768, 2, 32, 128, 8, True, "torch.bfloat16")
    other = ShapeKey(768, 2048, 1, 32, 128, 8, True, "torch.bfloat16")
    split = MoeLoraConfig("split", 128, 64, split_k=2)
    fused = MoeLoraConfig("fused", 128, 128)
    configs.write_configs(
        "Test GPU", {key.text(): {512: split, 2048: split}, other.text(): {8: split}}
    )
    configs.write_configs("Test GPU", {key.text(): {2048: fused, 204800: fused}})
    assert configs.lookup("Test GPU", key, 512, 132) == split  # not re-tuned: kept
    assert configs.lookup("Test GPU", key, 2048, 132) == fused  # re-tuned: replaced
    assert configs.lookup("Test GPU", key, 204800, 132) == fused  # new
    assert configs.lookup("Test GPU", other, 8, 132) == split  # another shape: kept


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"expand_parts": 3}, "expand_parts must be a power of 2 >= 1, got 3"),
        ({"expand_parts": 0}, "expand_parts must be a power of 2 >= 1, got 0"),
        ({"expand_tiles": 0}, "expand_tiles must be >= 1, got 0"),
        ({"max_registers": 8}, "max_registers must be between 16 and 255, got 8"),
        ({"max_registers": 256}, "max_registers must be between 16 and 255, got 256"),
    ],
)
def test_bad_launch_shape_names_the_field_and_bound(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoeLoraConfig("split", block_k=64, block_n=128, **fields)
