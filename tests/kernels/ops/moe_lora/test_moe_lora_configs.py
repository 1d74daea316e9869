"""The tuned-config file: a tuner run over some batches merges into what is there; a lookup
takes the nearest entry that serves the call; launch shapes it refuses."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.kernels.ops.moe_lora import configs as configs
from loraplex.kernels.ops.moe_lora.configs import Gpu, MoeLoraConfig, ShapeKey

TEST_GPU = Gpu("Test GPU", "sm_90", 132)
H200 = Gpu("NVIDIA H200", "sm_90", 132)


@pytest.fixture(autouse=True)
def _fresh_tables() -> Iterator[None]:
    """Each test reads the files it wrote: no table cached by another test (or another
    CONFIG_DIR) stays behind, before or after."""
    configs._table.cache_clear()
    yield
    configs._table.cache_clear()


def test_partial_tuning_keeps_other_pair_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    key = ShapeKey(2048, 768, 2, 32, 128, 8, True, "torch.bfloat16")
    other = ShapeKey(768, 2048, 1, 32, 128, 8, True, "torch.bfloat16")
    split = MoeLoraConfig("split", 128, 64, split_k=2)
    fused = MoeLoraConfig("fused", 128, 128)
    configs.write_configs(
        TEST_GPU, {key.text(): {512: split, 2048: split}, other.text(): {8: split}}
    )
    configs.write_configs(TEST_GPU, {key.text(): {2048: fused, 204800: fused}})
    assert configs.lookup(TEST_GPU, key, 512) == split  # not re-tuned: kept
    assert configs.lookup(TEST_GPU, key, 2048) == fused  # re-tuned: replaced
    assert configs.lookup(TEST_GPU, key, 204800) == fused  # new
    assert configs.lookup(TEST_GPU, other, 8) == split  # another shape: kept


def test_a_sorted_entry_serves_blocks_near_the_one_it_was_tuned_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry tuned at block 16 serves blocks 16 and 32, not 64 or 128 (its fused kernel took
    3x the best there); one whose block was not recorded serves any; with none left, the
    fallback; the naive form ignores blocks."""
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    key = ShapeKey(768, 2048, 1, 32, 128, 8, True, "torch.bfloat16")
    at16 = MoeLoraConfig("fused", 128, 128, tuned_block_m=16)
    legacy = MoeLoraConfig("split", 64, 128, expand_parts=4, expand_tiles=16)
    configs.write_configs(TEST_GPU, {key.text(): {2048: at16, 204800: legacy}})
    assert configs.lookup(TEST_GPU, key, 16384, block_m=16) == at16
    assert configs.lookup(TEST_GPU, key, 16384, block_m=32) == at16
    assert configs.lookup(TEST_GPU, key, 16384, block_m=64) == legacy
    assert configs.lookup(TEST_GPU, key, 2048, block_m=128) == legacy
    assert configs.lookup(TEST_GPU, key, 2048) == at16  # no block: nearest
    configs.write_configs(TEST_GPU, {key.text(): {204800: at16}})
    assert configs.lookup(TEST_GPU, key, 2048, block_m=128) == configs.fallback_config(
        key, 2048, 132
    )


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


def test_gemv_shrink_is_refused_outside_the_split_variant() -> None:
    with pytest.raises(ValueError, match="gemv_shrink"):
        MoeLoraConfig("fused", 128, 128, gemv_shrink=True)
    with pytest.raises(ValueError, match="gemv_shrink"):
        MoeLoraConfig("split", 128, 128, fuse_slices=True, gemv_shrink=True)


def test_gemv_expand_is_refused_outside_the_split_variant_and_over_tiles() -> None:
    with pytest.raises(ValueError, match="variant must be 'split' \\(got 'fused'\\)"):
        MoeLoraConfig("fused", 128, 128, gemv_expand=True)
    with pytest.raises(ValueError, match="expand_tiles 1 \\(got 2\\)"):
        MoeLoraConfig("split", 128, 128, expand_tiles=2, gemv_expand=True)


def test_lookup_takes_the_log_nearest_entry_and_the_larger_at_a_tie(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nearest on a log scale; at an exact geometric midpoint the larger entry, at every
    midpoint alike (float logs had sent 2,048 between 1,024 and 4,096 up, 16 between 8 and
    32 down)."""
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    key = ShapeKey(2880, 2880, 2, 32, 32, 4, True, "torch.bfloat16")
    small, mid, large = (MoeLoraConfig("split", 128, n) for n in (64, 128, 256))
    configs.write_configs(TEST_GPU, {key.text(): {8: small, 32: mid, 1024: small, 4096: large}})
    assert configs.lookup(TEST_GPU, key, 15) == small  # nearer 8 than 32 (16 is the middle)
    assert configs.lookup(TEST_GPU, key, 16) == mid  # 8 and 32 equally near
    assert configs.lookup(TEST_GPU, key, 2047) == small
    assert configs.lookup(TEST_GPU, key, 2048) == large  # 1,024 and 4,096 equally near
    assert configs.lookup(TEST_GPU, key, 0) == small  # no pairs: as one


def test_the_3d_gate_up_call_takes_the_two_slice_entries_of_half_its_width(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPT-OSS's gate/up LoRA comes as one slice of 2 x I columns (vLLM's 3D layout): it takes
    the two-slice entries of I, never another one-slice shape's; a one-slice key with entries
    of its own keeps them; an odd width or no twin gets the fallback."""
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    two = ShapeKey(2880, 2880, 2, 32, 32, 4, False, "torch.bfloat16")
    down = ShapeKey(2880, 2880, 1, 32, 32, 4, False, "torch.bfloat16")
    gemv = MoeLoraConfig("split", 128, 256, split_k=8, gemv_expand=True)
    other = MoeLoraConfig("split", 128, 1024, split_k=8, gemv_shrink=True, gemv_expand=True)
    configs.write_configs(TEST_GPU, {two.text(): {64: gemv}, down.text(): {64: other}})
    gate_up_3d = ShapeKey(2880, 5760, 1, 32, 32, 4, False, "torch.bfloat16")
    assert configs.lookup(TEST_GPU, gate_up_3d, 64) == gemv
    assert configs.lookup(TEST_GPU, down, 64) == other
    odd = ShapeKey(2880, 5761, 1, 32, 32, 4, False, "torch.bfloat16")
    assert configs.lookup(TEST_GPU, odd, 64) == configs.fallback_config(odd, 64, 132)
    sorted_3d = ShapeKey(2880, 5760, 1, 32, 32, 4, True, "torch.bfloat16")
    assert configs.lookup(TEST_GPU, sorted_3d, 64) == configs.fallback_config(sorted_3d, 64, 132)


def test_the_h200_file_serves_gpt_oss_3d_gate_up_tuned_entries() -> None:
    """The committed H200 file: GPT-OSS's gate/up call as vLLM 0.26 makes it (one slice of
    5,760 columns) is served a tuned entry at 16 decode tokens, not the fallback."""
    gate_up_3d = ShapeKey(2880, 5760, 1, 32, 32, 4, False, "torch.bfloat16")
    entries = configs.tuned_entries(configs._table(H200), gate_up_3d)
    assert entries
    assert configs.lookup(H200, gate_up_3d, 64) in entries.values()


def test_a_gpu_without_a_file_borrows_one_of_its_architecture_and_sm_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An H100 SXM (no file) is served the H200's entries, sm_90 and 132 SMs alike, and the log
    says whose; an H100 PCIe (114 SMs) and an sm_80 GPU of 132 SMs get the fallback. Once the
    H100 has a file of its own, its shapes win and a shape it lacks keeps the H200's."""
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    key = ShapeKey(2048, 768, 2, 32, 128, 8, False, "torch.bfloat16")
    down = ShapeKey(768, 2048, 1, 32, 128, 8, False, "torch.bfloat16")
    tuned = MoeLoraConfig("split", 128, 256, split_k=8, gemv_expand=True)
    own = MoeLoraConfig("split", 64, 128, split_k=4)
    configs.write_configs(H200, {key.text(): {64: tuned}, down.text(): {64: tuned}})
    h100 = Gpu("NVIDIA H100 80GB HBM3", "sm_90", 132)
    with caplog.at_level("WARNING", logger=configs.log.name):
        assert configs.lookup(h100, key, 64) == tuned
    assert "for NVIDIA H100 80GB HBM3: NVIDIA H200's (sm_90, 132 SMs alike)" in caplog.text
    for stranger in (Gpu("NVIDIA H100 PCIe", "sm_90", 114), Gpu("NVIDIA A100", "sm_80", 132)):
        assert configs.lookup(stranger, key, 64) == configs.fallback_config(key, 64, stranger.sms)
    configs.write_configs(h100, {key.text(): {64: own}})
    assert configs.lookup(h100, key, 64) == own
    assert configs.lookup(h100, down, 64) == tuned
    assert configs.lookup(H200, key, 64) == tuned


def test_the_committed_files_name_their_architecture_and_sm_count() -> None:
    """Every committed file can serve its siblings: it records arch and sms as `gpu_of` makes
    them."""
    files = sorted(configs.CONFIG_DIR.glob("moe_lora_*.json"))
    assert files
    for path in files:
        raw = json.loads(path.read_text())
        assert raw["arch"].startswith("sm_") and raw["sms"] > 0, path.name


def test_the_fallback_runs_decode_on_the_gemv_kernels_as_the_tuned_entries_do() -> None:
    """A GPU with no file of its own or a sibling's: the naive form at decode sizes gets the split
    variant's GEMV expand, and its GEMV shrink up to 16 pairs, as every H200 entry there chose;
    the sorted form keeps tl.dot tiles; many programs get one fused launch."""
    gate_up_3d = ShapeKey(2880, 5760, 1, 32, 32, 4, False, "torch.bfloat16")
    at_16_tokens = configs.fallback_config(gate_up_3d, 64, 108)
    assert (at_16_tokens.variant, at_16_tokens.gemv_shrink, at_16_tokens.gemv_expand) == (
        "split", False, True,
    )  # fmt: skip
    one_token = configs.fallback_config(gate_up_3d, 4, 108)
    assert one_token.gemv_shrink and one_token.gemv_expand
    sorted_form = configs.fallback_config(
        dataclasses.replace(gate_up_3d, sorted_form=True), 64, 108
    )
    assert (sorted_form.variant, sorted_form.gemv_shrink, sorted_form.gemv_expand) == (
        "split", False, False,
    )  # fmt: skip
    assert configs.fallback_config(gate_up_3d, 512, 108).variant == "fused"
    assert configs.lookup(Gpu("NVIDIA A100", "sm_80", 108), gate_up_3d, 64) == at_16_tokens
