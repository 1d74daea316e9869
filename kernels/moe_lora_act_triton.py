"""Triton body of the gate/up expand fused into SiLU-and-mul (launcher: `moe_lora_act`).

vLLM's fused experts add the gate/up LoRA into their intermediate buffer (read and write every
pair's 2N columns), then read it again for SiLU-and-mul. This kernel reads the buffer once, adds
the LoRA on chip and writes only the N activated columns. At a prefill of 16 x 1600 tokens
(Qwen3-30B-A3B, 204,800 pairs x 1,536 columns) that is 1.26 GB less traffic per MoE layer.

Its grid has two parts in one launch:
- LoRA programs, laid out as `moe_lora_expand_kernel`'s with both slices in one program: they
  sum the shrink's partials for gate and up, then for each of their TILES adjacent N tiles
  multiply by B's tiles, add to the buffer's tiles, and write SiLU(gate) x up for their unit's
  rows;
- plain programs, PLAIN_ROWS pairs each over all of N: they write SiLU(gate) x up for the pairs
  no LoRA program covers (no adapter, a disabled or inactive slot, no expert) and leave at once
  where every pair has one, as in a batch where every request names an adapter.

Rounding follows the unfused path: the LoRA sum is rounded to the buffer's dtype (as the expand
stores it), SiLU's result too, then the product (vLLM's `silu_and_mul`, in float, per element).
"""

import triton
import triton.language as tl

from .moe_lora_triton import _BATCH_ARGS, _resolve_unit, _slice_base, _tile_inputs


@triton.jit
def _silu_and_mul(gate, up):
    """SiLU(gate) x up as vLLM's silu_and_mul rounds it: both in the buffer's dtype."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _has_lora(pairs, pmask, expert_ids_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr, top_k, lora_dim,
              max_loras, SORTED: tl.constexpr, LORA_PAD: tl.constexpr):  # fmt: skip
    """Whether a LoRA program covers each pair: the rule of `_resolve_unit`, per pair. Its
    slot is loaded and enabled; in the sorted form the slot is among the active ids (the align
    sorted all of an active slot's pairs), in the naive form the pair has an expert."""
    slots = tl.load(tlm_ptr + pairs // top_k, mask=pmask, other=-1)
    ok = pmask & (slots >= 0) & (slots < max_loras)
    safe = tl.where(ok, slots, 0)
    ok = ok & (tl.load(enabled_ptr + safe, mask=ok, other=0) != 0)
    if SORTED:
        offs = tl.arange(0, LORA_PAD)
        ids = tl.load(lora_ids_ptr + offs, mask=offs < lora_dim, other=-1)
        listed = tl.max((safe[:, None] == ids[None, :]).to(tl.int32), 1) != 0
        ok = ok & listed
    else:
        ok = ok & (tl.load(expert_ids_ptr + pairs, mask=pmask, other=-1) >= 0)
    return ok


@triton.jit
def _gate_up_tile(b_gate_base, b_up_base, offs_n, N, tokens, tmask, gate_up_ptr, stride_bn,
                  stride_br, stride_gm, stride_gn, BLOCK_R: tl.constexpr,
                  RANK: tl.constexpr):  # fmt: skip
    """B's gate and up tiles at columns offs_n, the mask of the rows' tile there, and the
    buffer's gate and up values (columns offs_n and N + offs_n)."""
    b_gate, _, mask, gate = _tile_inputs(
        b_gate_base, offs_n, N, tokens, tmask, 0, gate_up_ptr, stride_bn, stride_br, stride_gm,
        stride_gn, BLOCK_R, RANK, True,
    )  # fmt: skip
    b_up, _, _, up = _tile_inputs(
        b_up_base, offs_n, N, tokens, tmask, N, gate_up_ptr, stride_bn, stride_br, stride_gm,
        stride_gn, BLOCK_R, RANK, True,
    )  # fmt: skip
    return b_gate, b_up, mask, gate, up


@triton.jit(do_not_specialize=[*_BATCH_ARGS, "lora_programs"])
def moe_lora_expand_silu_and_mul_kernel(
    ws_ptr,
    b0_ptr,
    b1_ptr,
    gate_up_ptr,
    out_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    tlm_ptr,
    lora_ids_ptr,
    enabled_ptr,
    N,
    num_pairs,
    top_k,
    num_m_blocks,
    em,
    num_units,
    lora_dim,
    max_loras,
    lora_programs,
    stride_bl,
    stride_be,
    stride_bn,
    stride_br,
    stride_gm,
    stride_gn,
    stride_om,
    stride_on,
    stride_sl,
    stride_el,
    SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    LORA_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    WS_ROWS: tl.constexpr,
    PARTS: tl.constexpr,
    TILES: tl.constexpr,
    PLAIN_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[p, n] = SiLU(gate_up[p, n] + dg[p, n]) x (gate_up[p, N + n] + du[p, n]), where
    (dg, du) = (sum_ks ws[s, unit, ks, row]) @ B[s][slot, expert].T for pairs with LoRA and 0
    for the others; gate_up (pairs, 2N) is only read."""
    pid = tl.program_id(0)
    if pid >= lora_programs:
        pairs = (pid - lora_programs) * PLAIN_ROWS + tl.arange(0, PLAIN_ROWS)
        pmask = pairs < num_pairs
        covered = _has_lora(pairs, pmask, expert_ids_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr,
                            top_k, lora_dim, max_loras, SORTED, LORA_PAD)  # fmt: skip
        plain = pmask & ~covered
        if tl.sum(plain.to(tl.int32), 0) == 0:
            return
        rows = gate_up_ptr + pairs.to(tl.int64)[:, None] * stride_gm
        out_rows = out_ptr + pairs.to(tl.int64)[:, None] * stride_om
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask = plain[:, None] & (offs_n < N)[None, :]
            gate = tl.load(rows + offs_n[None, :] * stride_gn, mask=mask, other=0.0)
            up = tl.load(rows + (N + offs_n)[None, :] * stride_gn, mask=mask, other=0.0)
            tl.store(out_rows + offs_n[None, :] * stride_on, _silu_and_mul(gate, up), mask=mask)
        return
    ROWS: tl.constexpr = BLOCK_M // PARTS
    groups = tl.cdiv(tl.cdiv(N, BLOCK_N), TILES)
    group = pid % groups
    rest = pid // groups
    part = rest % PARTS
    unit = rest // PARTS
    slot, expert, tokens, valid = _resolve_unit(
        unit, sorted_ptr, expert_ids_ptr, ntpp_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr,
        num_pairs, top_k, num_m_blocks, em, lora_dim, max_loras, stride_sl, stride_el,
        part * ROWS, SORTED, BLOCK_M, ROWS, LORA_PAD,
    )  # fmt: skip
    if valid == 0:
        return
    tmask = tokens < num_pairs
    if PARTS > 1:  # noqa: SIM102  (as in moe_lora_expand_kernel: all-padding parts leave)
        if tl.sum(tmask.to(tl.int32), 0) == 0:
            return
    offs_n = group * TILES * BLOCK_N + tl.arange(0, BLOCK_N)
    b_gate_base = _slice_base(b0_ptr, b1_ptr, 0, slot, expert, stride_bl, stride_be)
    b_up_base = _slice_base(b0_ptr, b1_ptr, 1, slot, expert, stride_bl, stride_be)
    # B and the buffer's tiles were written before the shrink let this grid launch (see
    # moe_lora_expand_kernel), so they load before the wait.
    b_gate, b_up, mask, gate, up = _gate_up_tile(
        b_gate_base, b_up_base, offs_n, N, tokens, tmask, gate_up_ptr, stride_bn, stride_br,
        stride_gm, stride_gn, BLOCK_R, RANK,
    )  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    offs_m = part * ROWS + tl.arange(0, ROWS)
    offs_r = tl.arange(0, BLOCK_R)
    rows_mask = ((offs_m < WS_ROWS) & tmask)[:, None]
    slice_cells = num_units.to(tl.int64) * SPLIT_K * (WS_ROWS * BLOCK_R)
    ptrs = ws_ptr + unit.to(tl.int64) * SPLIT_K * (WS_ROWS * BLOCK_R)
    ptrs += offs_m[:, None] * BLOCK_R + offs_r[None, :]
    tmp_gate = tl.zeros((ROWS, BLOCK_R), dtype=tl.float32)
    tmp_up = tl.zeros((ROWS, BLOCK_R), dtype=tl.float32)
    for _ks in tl.static_range(SPLIT_K):
        tmp_gate += tl.load(ptrs, mask=rows_mask, other=0.0)
        tmp_up += tl.load(ptrs + slice_cells, mask=rows_mask, other=0.0)
        ptrs += WS_ROWS * BLOCK_R
    tmp_gate = tmp_gate.to(b_gate.dtype)
    tmp_up = tmp_up.to(b_up.dtype)
    out_rows = out_ptr + tokens.to(tl.int64)[:, None] * stride_om
    # TILES adjacent N tiles per program: the partials above are read once for all of them, and
    # each tile's inputs load before the previous tile's result is stored.
    for i in tl.static_range(TILES):
        if i + 1 < TILES:
            next_n = offs_n + BLOCK_N
            next_b_gate, next_b_up, next_mask, next_gate, next_up = _gate_up_tile(
                b_gate_base, b_up_base, next_n, N, tokens, tmask, gate_up_ptr, stride_bn,
                stride_br, stride_gm, stride_gn, BLOCK_R, RANK,
            )  # fmt: skip
        gate = tl.dot(tmp_gate, b_gate).to(gate.dtype) + gate
        up = tl.dot(tmp_up, b_up).to(up.dtype) + up
        tl.store(out_rows + offs_n[None, :] * stride_on, _silu_and_mul(gate, up), mask=mask)
        if i + 1 < TILES:
            offs_n, b_gate, b_up, mask = next_n, next_b_gate, next_b_up, next_mask
            gate, up = next_gate, next_up
