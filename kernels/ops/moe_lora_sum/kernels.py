"""Triton body of moe_sum with the down LoRA's delta (launcher: `op.moe_sum_with_delta`)."""

import triton
import triton.language as tl

from loraplex.kernels.ops.shared import active_slots


@triton.jit(do_not_specialize=["num_tokens"])
def moe_sum_with_delta_kernel(
    experts_ptr,
    delta_ptr,
    out_ptr,
    tlm_ptr,
    enabled_ptr,
    num_tokens,
    hidden,
    max_loras,
    stride_et,
    stride_ek,
    stride_dt,
    stride_dk,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = rows < num_tokens
    mask = in_rows[:, None] & (cols < hidden)[None, :]
    _, on = active_slots(tl.load(tlm_ptr + rows, mask=in_rows, other=-1), enabled_ptr, max_loras)
    delta_mask = mask & on[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    experts = experts_ptr + rows64 * stride_et + cols[None, :]
    delta = delta_ptr + rows64 * stride_dt + cols[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(experts + k * stride_ek, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(delta + k * stride_dk, mask=delta_mask, other=0.0).to(tl.float32)
    out = out_ptr + rows64 * stride_ot + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
