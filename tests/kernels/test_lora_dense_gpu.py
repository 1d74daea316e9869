"""The dense LoRA op (decode and prefill kernels) on the GPU: bf16/fp16 against vLLM 0.26's own
lora_shrink + lora_expand (its kernels, its metadata), through the plugin's
torch.ops.loraplex.lora_linear and torch.ops.loraplex.linear_with_lora (the base GEMM too, at
decode sizes with the shrink beside it on a second stream, eager and in a CUDA graph).

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


@pytest.mark.parametrize("tokens", [1, 16, 64, 65, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_linear_with_lora_op_is_the_gemm_plus_vllms_lora(tokens: int, dtype: torch.dtype) -> None:
    """linear_with_lora against F.linear and then vLLM's shrink and expand; up to 64 tokens the
    op starts the shrink beside the GEMM."""
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


def _in_order(x: torch.Tensor, weight: torch.Tensor, a: Any, b: Any, tlm: Any) -> torch.Tensor:
    from loraplex.kernels.lora_dense_op import lora_dense

    y = torch.nn.functional.linear(x, weight)
    lora_dense(y, x, a, b, tlm)
    return y


def _slow_shrink_on(monkeypatch: pytest.MonkeyPatch) -> list[torch.cuda.Stream]:
    """Make lora_dense_beside's shrink sleep ~25 ms on its stream first; returns the streams it
    was launched on."""
    from loraplex.kernels import lora_dense_beside

    streams: list[torch.cuda.Stream] = []
    shrink = lora_dense_beside.lora_dense_shrink

    def slow_shrink(*args: Any, **kwargs: Any) -> None:
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(50_000_000)
        shrink(*args, **kwargs)

    monkeypatch.setattr(lora_dense_beside, "lora_dense_shrink", slow_shrink)
    return streams


def test_decode_shrink_runs_on_a_second_stream_between_the_right_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shrink must start after x is written (on the main stream after ~25 ms of sleep, over
    NaN) and the expand after the shrink (which sleeps ~25 ms on its stream first). The result
    must equal the layer run in order, bit for bit, and the shrink must have run on a stream
    other than the caller's."""
    from loraplex.kernels import lora_dense_beside

    streams = _slow_shrink_on(monkeypatch)
    x_values, weight, a, b, tlm = qkv_layer(16, torch.bfloat16, seed=5)
    in_order = _in_order(x_values, weight, a, b, tlm)
    x = torch.full_like(x_values, float("nan"))
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    x.copy_(x_values)
    out = lora_dense_beside.linear_with_shrink_beside(x, weight, None, a, b, 1.0, tlm)
    torch.cuda.synchronize()
    assert streams and streams[0] != torch.cuda.current_stream()
    assert torch.equal(out, in_order)


def test_decode_layer_captured_in_a_cuda_graph_replays_as_run_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As vLLM serves decode: the op run once eagerly (which compiles what the capture
    launches), then captured after a kernel that writes x late (~25 ms of sleep, then a copy),
    then replayed over a NaN x. The replay must equal the layer run in order, bit for bit: the
    captured shrink waited for x's copy, and the expand for the shrink (which sleeps ~25 ms
    first on its own stream, not the capture's)."""
    from loraplex.kernels.plugin import PluginState, register

    assert register(enabled=True) in (PluginState.PATCHED, PluginState.ALREADY)
    x_values, weight, a, b, tlm = qkv_layer(16, torch.bfloat16, seed=6)
    args = vllm_meta(tlm)
    in_order = _in_order(x_values, weight, a, b, tlm)
    x = torch.full_like(x_values, float("nan"))
    torch.ops.loraplex.linear_with_lora(x_values, weight, None, a, b, 1.0, *args)
    torch.cuda.synchronize()
    streams = _slow_shrink_on(monkeypatch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capture_stream = torch.cuda.current_stream()
        torch.cuda._sleep(50_000_000)
        x.copy_(x_values)
        out = torch.ops.loraplex.linear_with_lora(x, weight, None, a, b, 1.0, *args)
    assert streams and streams[0] != capture_stream
    x.fill_(float("nan"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, in_order)
