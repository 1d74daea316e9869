"""The dense LoRA op (decode and prefill kernels) on the GPU: bf16/fp16 against vLLM 0.26's own
lora_shrink + lora_expand (its kernels, its metadata), through the plugin's
torch.ops.loraplex.lora_linear.

    PYTHONPATH=/tmp/site:. python3 -m pytest -m gpu tests/kernels/ops/lora_dense
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [1, 5, 16, 64, 65, 1000, 25600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lora_linear_op_matches_vllm(tokens: int, dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B qkv shapes (2048 -> 4096 + 512 + 512), rank 32, 8 slots, some tokens
    without adapter; from 65 tokens on the op runs our tiled (prefill) kernels."""
    from vllm.lora.ops.triton_ops import LoRAKernelMeta
    from vllm.lora.ops.triton_ops.lora_expand_op import _lora_expand
    from vllm.lora.ops.triton_ops.lora_shrink_op import _lora_shrink

    from loraplex.kernels.vllm.plugin import PluginState, register

    assert register(enabled=True) in (PluginState.PATCHED, PluginState.ALREADY)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    widths, k, rank, slots = [4096, 512, 512], 2048, 32, 8
    x = torch.randn(tokens, k, device="cuda", generator=gen).to(dtype)
    a = [(torch.randn(slots, 1, rank, k, device="cuda", generator=gen) / k**0.5).to(dtype)
         for _ in widths]  # fmt: skip
    b = [(torch.randn(slots, 1, n, rank, device="cuda", generator=gen) / 8).to(dtype)
         for n in widths]  # fmt: skip
    tlm = torch.randint(-1, slots, (tokens,), device="cuda", generator=gen, dtype=torch.int32)
    tlm[0] = 3  # at least one token with an adapter
    meta = LoRAKernelMeta.make(slots, max(256, tokens), device="cuda")
    meta.prepare_tensors(tlm)
    args = meta.meta_args(tokens, False)
    # A zero base, so that the comparison is of the deltas, not of the base's rounding.
    y0 = torch.zeros(tokens, sum(widths), device="cuda", dtype=dtype)
    ours, theirs = y0.clone(), y0.clone()
    torch.ops.loraplex.lora_linear(ours, x, a, b, 1.0, *args, True)
    buffer = torch.empty((3, tokens, rank), dtype=torch.float32, device="cuda")
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
    from loraplex.kernels.ops.lora_dense.op import lora_dense
    from tests.support.moe_lora_cases import slowly_written

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


@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_one_launch_form_equals_two_launches_in_graphs_and_after_a_slow_writer(
    tokens: int,
) -> None:
    """`lora_dense_fused` (LORAPLEX_DECODE_VARIANT=dense_fused) in bf16 at Qwen3 qkv and o
    shapes: bit for bit the two-launch form's output, on a y written by the kernel just before
    (its PDL wait), and in a CUDA graph replayed 20 times (its counters back at zero after
    each launch)."""
    from loraplex.kernels.ops.lora_dense.op import lora_dense, lora_dense_fused, sync_cells
    from tests.support.moe_lora_cases import slowly_written

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    slots = 8
    for widths, k in (([4096, 512, 512], 2048), ([2048], 4096)):
        x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16()
        a = [(torch.randn(slots, 1, 32, k, device="cuda", generator=gen) / k**0.5).bfloat16()
             for _ in widths]  # fmt: skip
        b = [(torch.randn(slots, 1, n, 32, device="cuda", generator=gen) / 8).bfloat16()
             for n in widths]  # fmt: skip
        tlm = torch.arange(tokens, device="cuda", dtype=torch.int32) % (slots + 1) - 1
        base = torch.randn(tokens, sum(widths), device="cuda", generator=gen).bfloat16()
        want = base.clone()
        lora_dense(want, x, a, b, tlm)
        racing, rewrite = slowly_written(base)
        torch.cuda.synchronize()
        rewrite()
        lora_dense_fused(racing, x, a, b, tlm)
        torch.cuda.synchronize()
        assert torch.equal(racing, want)
        y = base.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            lora_dense_fused(y, x, a, b, tlm)  # compiles outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                lora_dense_fused(y, x, a, b, tlm)
        for _ in range(20):
            y.copy_(base)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, want)
        assert not sync_cells(x.device, len(widths) * tokens).any()
