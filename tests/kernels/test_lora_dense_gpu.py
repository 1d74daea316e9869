"""The dense LoRA op (decode and prefill kernels) on the GPU: bf16/fp16 against vLLM 0.26's own
lora_shrink + lora_expand (its kernels, its metadata), through the plugin's
torch.ops.loraplex.lora_linear and torch.ops.loraplex.linear_with_lora (the base GEMM too, at
prefill sizes with the shrink beside it on a second stream).

    PYTHONPATH=/tmp/site:. python3 -m pytest -m gpu tests/kernels/test_lora_dense_gpu.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

QKV = [4096, 512, 512]  # Qwen3-30B-A3B q, k, v widths; hidden 2048


def qkv_layer(tokens: int, dtype: torch.dtype, seed: int) -> tuple[Any, ...]:
    """(x, weight, A, B, token_lora_mapping) of a qkv layer, rank 32, 8 slots, some tokens
    without adapter (the first on slot 3)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, rank, slots = 2048, 32, 8
    x = torch.randn(tokens, k, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(sum(QKV), k, device="cuda", generator=gen) / k**0.5).to(dtype)
    a = [(torch.randn(slots, 1, rank, k, device="cuda", generator=gen) / k**0.5).to(dtype)
         for _ in QKV]  # fmt: skip
    b = [(torch.randn(slots, 1, n, rank, device="cuda", generator=gen) / 8).to(dtype)
         for n in QKV]  # fmt: skip
    tlm = torch.randint(-1, slots, (tokens,), device="cuda", generator=gen, dtype=torch.int32)
    tlm[0] = 3
    return x, weight, a, b, tlm


def vllm_meta(tlm: torch.Tensor, slots: int = 8) -> tuple[Any, ...]:
    """vLLM's LoRAKernelMeta arguments for the batch."""
    from vllm.lora.ops.triton_ops import LoRAKernelMeta

    meta = LoRAKernelMeta.make(slots, max(256, tlm.numel()), device="cuda")
    meta.prepare_tensors(tlm)
    return tuple(meta.meta_args(tlm.numel(), False))


@pytest.mark.parametrize("tokens", [1, 5, 16, 64, 65, 1000, 25600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lora_linear_op_matches_vllm(tokens: int, dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B qkv shapes (2048 -> 4096 + 512 + 512), rank 32, 8 slots, some tokens
    without adapter; from 65 tokens on the op runs our tiled (prefill) kernels."""
    from vllm.lora.ops.triton_ops.lora_expand_op import _lora_expand
    from vllm.lora.ops.triton_ops.lora_shrink_op import _lora_shrink

    from loraplex.kernels.plugin import PluginState, register

    assert register(enabled=True) in (PluginState.PATCHED, PluginState.ALREADY)
    x, _, a, b, tlm = qkv_layer(tokens, dtype, seed=tokens)
    args = vllm_meta(tlm)
    # A zero base, so that the comparison is of the deltas, not of the base's rounding.
    y0 = torch.zeros(tokens, sum(QKV), device="cuda", dtype=dtype)
    ours, theirs = y0.clone(), y0.clone()
    torch.ops.loraplex.lora_linear(ours, x, a, b, 1.0, *args, True)
    buffer = torch.empty((3, tokens, 32), dtype=torch.float32, device="cuda")
    _lora_shrink(x, a, buffer, *args, 1.0)
    _lora_expand(buffer, b, theirs, *args, offset_start=0, add_inputs=True)
    err = float((ours.float() - theirs.float()).norm() / theirs.float().norm())
    assert err < 2e-2, err
    assert not ours[tlm < 0].any()


def test_expand_reads_y_only_after_the_kernel_before() -> None:
    """The decode expand loads y before its PDL wait, which waits for the shrink only: safe
    because the shrink, itself launched under PDL, first waits for the kernel before it. Here
    that kernel writes y just before the call; the result must equal a call on a y written long
    before."""
    from moe_lora_cases import slowly_written

    from loraplex.kernels.lora_dense_op import lora_dense

    gen = torch.Generator(device="cuda").manual_seed(7)
    widths, k, rank, slots, tokens = [4096, 512, 512], 2048, 32, 8, 16
    x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16()
    a = [(torch.randn(slots, 1, rank, k, device="cuda", generator=gen) / k**0.5).bfloat16()
         for _ in widths]  # fmt: skip
    b = [(torch.randn(slots, 1, n, rank, device="cuda", generator=gen) / 8).bfloat16()
         for n in widths]  # fmt: skip
    tlm = torch.arange(tokens, device="cuda", dtype=torch.int32) % slots
    settled = torch.randn(tokens, sum(widths), device="cuda", generator=gen).bfloat16()
    racing, rewrite = slowly_written(settled)
    torch.cuda.synchronize()
    rewrite()
    lora_dense(racing, x, a, b, tlm)
    lora_dense(settled, x, a, b, tlm)
    torch.cuda.synchronize()
    assert torch.equal(racing, settled)


@pytest.mark.parametrize("tokens", [16, 1000, 2048, 25600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_linear_with_lora_op_is_the_gemm_plus_vllms_lora(tokens: int, dtype: torch.dtype) -> None:
    """linear_with_lora against F.linear and then vLLM's shrink and expand; from 2,048 tokens
    on the op starts the shrink beside the GEMM."""
    from vllm.lora.ops.triton_ops.lora_expand_op import _lora_expand
    from vllm.lora.ops.triton_ops.lora_shrink_op import _lora_shrink

    from loraplex.kernels.plugin import PluginState, register

    assert register(enabled=True) in (PluginState.PATCHED, PluginState.ALREADY)
    x, weight, a, b, tlm = qkv_layer(tokens, dtype, seed=tokens)
    args = vllm_meta(tlm)
    ours = torch.ops.loraplex.linear_with_lora(x, weight, None, a, b, 1.0, *args)
    gemm = torch.nn.functional.linear(x, weight)
    theirs = gemm.clone()
    buffer = torch.empty((3, tokens, 32), dtype=torch.float32, device="cuda")
    _lora_shrink(x, a, buffer, *args, 1.0)
    _lora_expand(buffer, b, theirs, *args, offset_start=0, add_inputs=True)
    assert torch.equal(ours[tlm < 0], gemm[tlm < 0])
    delta_ours, delta_theirs = ours.float() - gemm.float(), theirs.float() - gemm.float()
    err = float((delta_ours - delta_theirs).norm() / delta_theirs.norm())
    assert err < 2e-2, err


def test_prefill_shrink_runs_on_a_second_stream_between_the_right_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shrink must start after x is written (x is written on the main stream after ~25 ms of
    sleep, over poison) and the expand after the shrink (the shrink sleeps ~25 ms on its
    stream first, and its output's block held NaN). The result must equal the same layer run in
    order, and the shrink must have run on a stream other than the caller's."""
    from loraplex.kernels import lora_dense_beside
    from loraplex.kernels.lora_dense_tiled import lora_dense_tiled, lora_sort_meta

    streams: list[torch.cuda.Stream] = []
    shrink = lora_dense_beside.lora_dense_tiled_shrink

    def slow_shrink(*args: Any) -> None:
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(50_000_000)
        shrink(*args)

    monkeypatch.setattr(lora_dense_beside, "lora_dense_tiled_shrink", slow_shrink)
    tokens = 4096
    x_values, weight, a, b, tlm = qkv_layer(tokens, torch.bfloat16, seed=5)
    meta = lora_sort_meta(tlm, 8)
    in_order = torch.nn.functional.linear(x_values, weight)
    lora_dense_tiled(in_order, x_values, a, b, 1.0, *meta)
    x = torch.full_like(x_values, float("nan"))
    poison = torch.full((3, tokens, 32), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    del poison  # the shrink's output likely gets this block back
    torch.cuda._sleep(50_000_000)
    x.copy_(x_values)
    assert lora_dense_beside.goes_beside(x, weight, a, b)
    out = lora_dense_beside.linear_with_shrink_beside(x, weight, None, a, b, 1.0, *meta)
    torch.cuda.synchronize()
    assert streams and streams[0] != torch.cuda.current_stream()
    assert torch.equal(out, in_order)


def test_nothing_goes_beside_during_a_cuda_graph_capture() -> None:
    from loraplex.kernels import lora_dense_beside

    x, weight, a, b, _ = qkv_layer(lora_dense_beside.SIDE_MIN_TOKENS, torch.bfloat16, seed=6)
    assert lora_dense_beside.goes_beside(x, weight, a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lora_dense_beside.goes_beside(x, weight, a, b)
    assert not captured
