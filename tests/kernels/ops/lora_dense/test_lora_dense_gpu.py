"""The dense LoRA op (decode and prefill kernels) on the GPU: bf16/fp16 against vLLM 0.26's own
lora_shrink + lora_expand (its kernels, its metadata), through the plugin's
torch.ops.loraplex.lora_linear; the decode kernel against the spec after a slow writer and in
CUDA graphs.

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


@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_decode_op_matches_reference_after_a_slow_writer_and_in_graphs(tokens: int) -> None:
    """`lora_dense` in bf16 at Qwen3 qkv and o shapes: the spec's deltas (within the bound of
    `test_lora_linear_op_matches_vllm`), tokens without adapter untouched; on a y written by
    the kernel just before the call, the same bits as on a y written long before (the expand
    programs load y only after their PDL wait, which waits for that kernel); and in a CUDA graph
    replayed 20 times, the same bits again (the counters back at zero after each launch)."""
    from loraplex.kernels.ops.lora_dense.op import lora_dense, sync_cells
    from loraplex.kernels.ops.lora_dense.reference import lora_dense_reference
    from tests.support.moe_lora_cases import slowly_written

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    slots = 8
    for widths, k in (([4096, 512, 512], 2048), ([2048], 4096)):
        x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16()
        a = [(torch.randn(slots, 1, 32, k, device="cuda", generator=gen) / k**0.5).bfloat16()
             for _ in widths]  # fmt: skip
        b = [(torch.randn(slots, 1, n, 32, device="cuda", generator=gen) / 8).bfloat16()
             for n in widths]  # fmt: skip
        # Slots 0, 1, ..., 7, then a token without adapter, in turn.
        tlm = torch.arange(1, tokens + 1, device="cuda", dtype=torch.int32) % (slots + 1) - 1
        base = torch.randn(tokens, sum(widths), device="cuda", generator=gen).bfloat16()
        want = base.clone()
        torch.cuda.synchronize()
        lora_dense(want, x, a, b, tlm)
        ref = base.double().cpu()
        lora_dense_reference(ref, x.cpu(), [t.cpu() for t in a], [t.cpu() for t in b], tlm.cpu())
        got, before, touched = want.double().cpu(), base.double().cpu(), tlm.cpu() >= 0
        assert torch.equal(got[~touched], before[~touched])
        delta, ref_delta = (got - before)[touched], (ref - before)[touched]
        err = float((delta - ref_delta).norm() / ref_delta.norm())
        assert err < 2e-2, err
        racing, rewrite = slowly_written(base)
        torch.cuda.synchronize()
        rewrite()
        lora_dense(racing, x, a, b, tlm)
        torch.cuda.synchronize()
        assert torch.equal(racing, want)
        y = base.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            lora_dense(y, x, a, b, tlm)  # compiles outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                lora_dense(y, x, a, b, tlm)
        for _ in range(20):
            y.copy_(base)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, want)
        with torch.cuda.stream(stream):  # the counters the captured launches use
            assert not sync_cells(x.device, len(widths) * tokens).any()
