"""Triton body of the gate/up expand fused into the activation (launcher: `act`).

vLLM's fused experts add the gate/up LoRA into their intermediate buffer (read and write every
pair's 2N columns), then read it again for the activation. This kernel reads the buffer once, adds
the LoRA on chip and writes only the N activated columns. At a prefill of 16 x 1600 tokens
(Qwen3-30B-A3B, 204,800 pairs x 1,536 columns) that is 1.26 GB less traffic per MoE layer.

Its grid has two parts in one launch:
- LoRA programs, one per (unit, N tile), both slices in one program: B's gate and up tiles
  load once, then in the sorted form the unit's rows go by in chunks of CHUNK: the shrink's
  partials for gate and up summed, multiplied by B, added to the buffer's tiles, act(gate,
  up) written, the next chunk's inputs loaded before this one's store. B is read once per unit
  and tile, not per chunk: at 16 x 1600 tokens its tiles were 1.3 GB of L2 reads per layer
  when every 16-row program read all of a slot-expert's B (`act` has the
  measurements). In the naive form (decode) a unit is one pair, and its program works on that
  row alone, whatever the config's `gemv_expand` (`_gemv_activation`);
- plain programs, PLAIN_ROWS pairs each over all of N: they write act(gate, up) for the pairs
  no LoRA program covers (no adapter, a disabled or inactive slot, no expert) and leave at once
  where every pair has one, as in a batch where every request names an adapter.

Two layouts of vLLM's gate/up call, each with its activation (SWIGLUOAI, a constexpr, picks):
- two slices side by side (Qwen3: `FusedMoEWithLoRA`), gate columns 0..N, up N..2N, two A and
  two B: SiLU-and-mul;
- one slice of 2N columns, gate and up interleaved (GPT-OSS: `FusedMoE3DWithLoRA`; gate column
  2j, up 2j + 1, as its checkpoint's gate_up_proj and vLLM's `swigluoai_and_mul` read them), one
  A and one B of 2N rows: swigluoai. The kernel sees it as two virtual slices of N columns: the
  buffer's tiles load as one contiguous (rows, N tile, 2) tile split into gate and up, B's gate
  and up rows go by a doubled row stride, and both share the one shrink's partials.

Rounding follows the unfused path: the LoRA sum is rounded to the buffer's dtype (as the expand
stores it); then vLLM's `silu_and_mul` rounds SiLU's result to that dtype and then the product,
and its `swigluoai_and_mul` computes in float from the buffer's values and rounds once.
"""

import triton
import triton.language as tl

from loraplex.kernels.ops.shared import (
    MOE_BATCH_ARGS,
    active_slots,
    gemv_delta,
    gemv_partials,
    load_b,
    locate_unit,
    output_tile,
    slice_base,
    sum_partials,
    unit_rows,
)


@triton.jit
def _silu_and_mul(gate, up):
    """SiLU(gate) x up as vLLM's silu_and_mul rounds it: both in the buffer's dtype."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _swigluoai_and_mul(gate, up, alpha, limit):
    """vLLM's swigluoai_and_mul, element by element: gate clamped to at most limit, up to
    [-limit, limit], gate x sigmoid(alpha x gate) x (up + 1) in float from the buffer's dtype,
    rounded once. A NaN stays NaN, as in vLLM's torch form (`SwigluOAIAndMul.forward_native`)
    and its older CUDA kernel; its newer CUDA kernel clamps with fminf, which turns a NaN into
    the limit. Only a poisoned adapter's own rows hold NaN here, and kept, they reach the
    engine's finite guard (docs/isolation.md)."""
    g = gate.to(tl.float32)
    g = tl.where(g > limit, limit, g)
    u = up.to(tl.float32)
    u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    glu = g * (1.0 / (1.0 + tl.exp(-g * alpha)))
    return ((u + 1.0) * glu).to(gate.dtype)


@triton.jit
def _activation(gate, up, alpha, limit, SWIGLUOAI: tl.constexpr):
    if SWIGLUOAI:
        return _swigluoai_and_mul(gate, up, alpha, limit)
    else:
        return _silu_and_mul(gate, up)


@triton.jit
def _load_gate_up(gate_up_ptr, pairs, pmask, offs_n, N, stride_gm, stride_gn,
                  SWIGLUOAI: tl.constexpr):  # fmt: skip
    """The buffer's gate and up tiles at columns offs_n of the pairs where pmask (0 elsewhere):
    columns offs_n and N + offs_n, or interleaved (SWIGLUOAI) 2 x offs_n and 2 x offs_n + 1, read
    as one (rows, columns, 2) tile of contiguous pairs of columns and split."""
    if SWIGLUOAI:
        cols = 2 * offs_n[None, :, None] + tl.arange(0, 2)[None, None, :]
        ptrs = gate_up_ptr + pairs.to(tl.int64)[:, None, None] * stride_gm + cols * stride_gn
        mask = pmask[:, None, None] & (offs_n < N)[None, :, None]
        return tl.split(tl.load(ptrs, mask=mask, other=0.0))
    else:
        gate_ptrs, mask = output_tile(pairs, pmask, offs_n, N, 0, gate_up_ptr, stride_gm,
                                      stride_gn)  # fmt: skip
        up_ptrs, _ = output_tile(pairs, pmask, offs_n, N, N, gate_up_ptr, stride_gm, stride_gn)
        return tl.load(gate_ptrs, mask=mask, other=0.0), tl.load(up_ptrs, mask=mask, other=0.0)


@triton.jit
def _store_activation(out_ptr, pairs, pmask, offs_n, N, gate, up, stride_om, stride_on, alpha,
                      limit, SWIGLUOAI: tl.constexpr):  # fmt: skip
    """out[pairs, offs_n] = act(gate, up) for the pairs where pmask."""
    ptrs, mask = output_tile(pairs, pmask, offs_n, N, 0, out_ptr, stride_om, stride_on)
    tl.store(ptrs, _activation(gate, up, alpha, limit, SWIGLUOAI), mask=mask)


@triton.jit
def _has_lora(pairs, pmask, expert_ids_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr, top_k, lora_dim,
              max_loras, SORTED: tl.constexpr, LORA_PAD: tl.constexpr):  # fmt: skip
    """Whether a LoRA program covers each pair: the rule of `_resolve_unit`, per pair. Its
    slot is loaded and enabled; in the sorted form the slot is among the active ids (the align
    sorted all of an active slot's pairs), in the naive form the pair has an expert."""
    safe, ok = active_slots(tl.load(tlm_ptr + pairs // top_k, mask=pmask, other=-1),
                             enabled_ptr, max_loras)  # fmt: skip
    if SORTED:
        offs = tl.arange(0, LORA_PAD)
        ids = tl.load(lora_ids_ptr + offs, mask=offs < lora_dim, other=-1)
        listed = tl.max((safe[:, None] == ids[None, :]).to(tl.int32), 1) != 0
        ok = ok & listed
    else:
        ok = ok & (tl.load(expert_ids_ptr + pairs, mask=pmask, other=-1) >= 0)
    return ok


@triton.jit
def _chunk_inputs(c, slot, blk, sorted_ptr, num_pairs, em, stride_sl, offs_n, N, gate_up_ptr,
                  stride_gm, stride_gn, unit_ws, slice_cells, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
                  WS_ROWS: tl.constexpr, SWIGLUOAI: tl.constexpr):  # fmt: skip
    """What chunk c of a sorted unit's rows needs at columns offs_n: its pair ids and their
    mask, the buffer's gate and up values there, and the shrink's partials for gate and up
    summed over its K ranges (one slice's for both where SWIGLUOAI). Chunks past the unit's
    rows load nothing."""
    pairs = unit_rows(slot, blk, c * CHUNK, sorted_ptr, num_pairs, em, stride_sl, True,
                       BLOCK_M, CHUNK)  # fmt: skip
    pmask = pairs < num_pairs
    gate, up = _load_gate_up(gate_up_ptr, pairs, pmask, offs_n, N, stride_gm, stride_gn,
                             SWIGLUOAI)  # fmt: skip
    offs_m = c * CHUNK + tl.arange(0, CHUNK)
    dgate = sum_partials(unit_ws, offs_m, pmask, SPLIT_K, WS_ROWS, BLOCK_R, CHUNK)
    if SWIGLUOAI:
        dup = dgate
    else:
        dup = sum_partials(unit_ws + slice_cells, offs_m, pmask, SPLIT_K, WS_ROWS, BLOCK_R, CHUNK)
    return pairs, pmask, gate, up, dgate, dup


@triton.jit
def _gemv_activation(pair, pair_ws, slice_cells, b_gate, b_up, offs_n, N, gate_up_ptr, out_ptr,
                     stride_gm, stride_gn, stride_om, stride_on, alpha, limit,
                     SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr,
                     SWIGLUOAI: tl.constexpr):  # fmt: skip
    """A naive-form LoRA program: one pair, so its row as vectors, not a 16-row tile of which
    one row is real (`gemv_kernels`). The buffer row loads before the PDL wait, as the
    expand's output tile does."""
    nmask = offs_n < N
    row = gate_up_ptr + pair.to(tl.int64) * stride_gm
    if SWIGLUOAI:
        cols = 2 * offs_n[:, None] + tl.arange(0, 2)[None, :]
        gate, up = tl.split(tl.load(row + cols * stride_gn, mask=nmask[:, None], other=0.0))
    else:
        gate = tl.load(row + offs_n * stride_gn, mask=nmask, other=0.0)
        up = tl.load(row + (N + offs_n) * stride_gn, mask=nmask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if SWIGLUOAI:
        partials = gemv_partials(pair_ws, SPLIT_K, BLOCK_R)  # one slice's, for gate and up
        gate += gemv_delta(b_gate, partials).to(gate.dtype)
        up += gemv_delta(b_up, partials).to(up.dtype)
    else:
        gate += gemv_delta(b_gate, gemv_partials(pair_ws, SPLIT_K, BLOCK_R)).to(gate.dtype)
        up += gemv_delta(b_up, gemv_partials(pair_ws + slice_cells, SPLIT_K, BLOCK_R)).to(up.dtype)
    out = out_ptr + pair.to(tl.int64) * stride_om + offs_n * stride_on
    tl.store(out, _activation(gate, up, alpha, limit, SWIGLUOAI), mask=nmask)


@triton.jit(do_not_specialize=[*MOE_BATCH_ARGS, "lora_programs"])
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
    alpha,
    limit,
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
    CHUNK: tl.constexpr,
    PLAIN_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    SWIGLUOAI: tl.constexpr,
):
    """out[p, n] = SiLU(gate_up[p, n] + dg[p, n]) x (gate_up[p, N + n] + du[p, n]), where
    (dg, du) = (sum_ks ws[s, unit, ks, row]) @ B[s][slot, expert].T for pairs with LoRA and 0
    for the others; gate_up (pairs, 2N) is only read. With SWIGLUOAI:
    out[p, n] = swigluoai(gate_up[p, 2n] + d[p, 2n], gate_up[p, 2n + 1] + d[p, 2n + 1]) with
    d = (sum_ks ws[0, unit, ks, row]) @ B[0][slot, expert].T (B of 2N rows), alpha and limit
    as vLLM's op takes them."""
    pid = tl.program_id(0)
    if pid >= lora_programs:
        pairs = (pid - lora_programs) * PLAIN_ROWS + tl.arange(0, PLAIN_ROWS)
        pmask = pairs < num_pairs
        covered = _has_lora(pairs, pmask, expert_ids_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr,
                            top_k, lora_dim, max_loras, SORTED, LORA_PAD)  # fmt: skip
        plain = pmask & ~covered
        if tl.sum(plain.to(tl.int32), 0) == 0:
            return
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            gate, up = _load_gate_up(gate_up_ptr, pairs, plain, offs_n, N, stride_gm, stride_gn,
                                     SWIGLUOAI)  # fmt: skip
            _store_activation(out_ptr, pairs, plain, offs_n, N, gate, up, stride_om, stride_on,
                              alpha, limit, SWIGLUOAI)  # fmt: skip
        return
    n_tiles = tl.cdiv(N, BLOCK_N)
    tile = pid % n_tiles
    unit = pid // n_tiles
    slot, blk, expert, valid = locate_unit(
        unit, expert_ids_ptr, ntpp_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr, top_k, num_m_blocks,
        lora_dim, max_loras, stride_el, SORTED, BLOCK_M, LORA_PAD,
    )  # fmt: skip
    if valid == 0:
        return
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    # B was written before the shrink let this grid launch (see moe_lora_expand_kernel), so its
    # tiles load before the wait; they stay in registers for all of the unit's chunks.
    if SWIGLUOAI:
        # B's gate rows are 2n, its up rows 2n + 1.
        b_base = slice_base(b0_ptr, b1_ptr, 0, slot, expert, stride_bl, stride_be)
        b_gate = load_b(b_base, offs_n, N, 2 * stride_bn, stride_br, BLOCK_R, RANK)
        b_up = load_b(b_base + stride_bn, offs_n, N, 2 * stride_bn, stride_br, BLOCK_R, RANK)
    else:
        b_gate = load_b(slice_base(b0_ptr, b1_ptr, 0, slot, expert, stride_bl, stride_be),
                         offs_n, N, stride_bn, stride_br, BLOCK_R, RANK)  # fmt: skip
        b_up = load_b(slice_base(b0_ptr, b1_ptr, 1, slot, expert, stride_bl, stride_be), offs_n,
                       N, stride_bn, stride_br, BLOCK_R, RANK)  # fmt: skip
    slice_cells = num_units.to(tl.int64) * SPLIT_K * (WS_ROWS * BLOCK_R)
    unit_ws = ws_ptr + unit.to(tl.int64) * SPLIT_K * (WS_ROWS * BLOCK_R)
    if not SORTED:
        tl.static_assert(WS_ROWS == 1)
        _gemv_activation(unit, unit_ws, slice_cells, b_gate, b_up, offs_n, N, gate_up_ptr,
                         out_ptr, stride_gm, stride_gn, stride_om, stride_on, alpha, limit,
                         SPLIT_K, BLOCK_R, USE_PDL, SWIGLUOAI)  # fmt: skip
        return
    # Sorted blocks are filled from row 0: the chunks run up to the last real pair.
    all_pairs = unit_rows(slot, blk, 0, sorted_ptr, num_pairs, em, stride_sl, SORTED, BLOCK_M,
                           BLOCK_M)  # fmt: skip
    last = tl.max(tl.where(all_pairs < num_pairs, tl.arange(0, BLOCK_M), -1), 0)
    chunks = tl.cdiv(last + 1, CHUNK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pairs, pmask, gate, up, dgate, dup = _chunk_inputs(
        0, slot, blk, sorted_ptr, num_pairs, em, stride_sl, offs_n, N, gate_up_ptr, stride_gm,
        stride_gn, unit_ws, slice_cells, BLOCK_M, CHUNK, BLOCK_R, SPLIT_K, WS_ROWS, SWIGLUOAI,
    )  # fmt: skip
    # Each chunk's inputs load before the previous chunk's result is stored.
    for c in range(0, chunks):
        next_inputs = _chunk_inputs(
            c + 1, slot, blk, sorted_ptr, num_pairs, em, stride_sl, offs_n, N, gate_up_ptr,
            stride_gm, stride_gn, unit_ws, slice_cells, BLOCK_M, CHUNK, BLOCK_R, SPLIT_K, WS_ROWS,
            SWIGLUOAI,
        )  # fmt: skip
        gate = tl.dot(dgate.to(b_gate.dtype), b_gate).to(gate.dtype) + gate
        up = tl.dot(dup.to(b_up.dtype), b_up).to(up.dtype) + up
        _store_activation(out_ptr, pairs, pmask, offs_n, N, gate, up, stride_om, stride_on,
                          alpha, limit, SWIGLUOAI)  # fmt: skip
        pairs, pmask, gate, up, dgate, dup = next_inputs
