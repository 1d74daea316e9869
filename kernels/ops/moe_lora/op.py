"""The fused MoE-LoRA op: checks shapes, allocates, picks a config and launches the Triton kernels.

`fused_moe_lora` has vLLM 0.26's signature and semantics (see `reference` for the spec
and every tensor's shape), so the vLLM plugin can swap it in. vLLM's shrink/expand tuning
arguments are accepted and ignored, except `shrink_block_size_m`: in the sorted routing form the
pairs were padded to blocks of that size, so the kernels use it as BLOCK_M.

No host syncs: the only host read is `num_active_loras`, a CPU tensor by vLLM's contract, so the
op can be captured in CUDA graphs; grids depend on shapes only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from loraplex.kernels.dispatch import REGIMES
from loraplex.kernels.ops.moe_lora import gemv_kernels as gemv
from loraplex.kernels.ops.moe_lora import kernels as kt
from loraplex.kernels.ops.moe_lora.configs import Gpu, MoeLoraConfig, ShapeKey, gpu_of, lookup

NAIVE_BLOCK_M = 16  # tl.dot needs >= 16 rows; the naive form uses row 0 of each tile.
# Ranks up to this fit on chip (the shrink's result is a BLOCK_R-wide tile per row).
MAX_RANK = 128


class UnsupportedMoeLoraCall(ValueError):
    """A call this op does not cover (the plugin hands such calls to vLLM's own op)."""


@lru_cache(maxsize=8)
def _device_facts(index: int) -> tuple[Gpu, bool]:
    props = torch.cuda.get_device_properties(index)
    return gpu_of(props), props.major >= 9


def _device_info(device: torch.device) -> tuple[Gpu, bool]:
    """(the GPU, supports PDL); the interpreter on a CPU gets a neutral stand-in."""
    if device.type != "cuda":
        return Gpu("cpu", "cpu", 4), False
    return _device_facts(device.index if device.index is not None else 0)


def _sorted_units(
    num_pairs: int, block_m: int, em: int, blocks: int, lora_dim: int, slots: int, experts: int
) -> int:
    """Programs for the sorted form: a bound on the blocks present, from shapes alone.

    Slot l's pairs n_l fall in e_l expert groups, each padded to a multiple of block_m, so it has
    fewer than n_l / block_m + e_l blocks; summed, fewer than P / block_m + slots x groups. The
    group count is bounded by the experts vLLM's align op sorted by, read off the padded length
    em = P + E x (block_m - 1) (more experts than ours under expert parallelism).
    """
    groups = max(experts, -(-(em - num_pairs) // max(block_m - 1, 1)))
    bound = -(-num_pairs // block_m) + min(lora_dim, slots) * min(groups, num_pairs)
    return min(lora_dim * blocks, bound)


def _check(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    topk_weights: torch.Tensor,
    top_k: int,
    mul_routed_weight: bool,
    offset: int,
) -> None:
    slices = len(lora_a)
    if slices not in (1, 2) or len(lora_b) != slices:
        raise UnsupportedMoeLoraCall(f"slices must be 1 or 2 with as many B as A, got {slices}")
    if output.dim() != 3 or output.shape[1] != top_k or topk_weights.shape != output.shape[:2]:
        raise ValueError(
            f"output {tuple(output.shape)} must be (tokens, top_k={top_k}, cols) matching "
            f"topk_weights {tuple(topk_weights.shape)}"
        )
    if output.stride(0) != output.shape[1] * output.stride(1):
        raise ValueError(f"output strides {output.stride()} must flatten (tokens, top_k)")
    a0, b0 = lora_a[0], lora_b[0]
    if a0.dim() != 4 or b0.dim() != 4 or a0.shape[2] != b0.shape[3]:
        raise ValueError(f"A {tuple(a0.shape)} / B {tuple(b0.shape)} must be (L,E,R,K) / (L,E,N,R)")
    if any(t.shape != a0.shape or t.stride() != a0.stride() for t in lora_a) or any(
        t.shape != b0.shape or t.stride() != b0.stride() for t in lora_b
    ):
        raise UnsupportedMoeLoraCall("all slices must share one shape and stride")
    rows = output.shape[0] * top_k if mul_routed_weight else output.shape[0]
    if x.shape != (rows, a0.shape[3]):
        raise ValueError(f"x {tuple(x.shape)} must be ({rows}, K={a0.shape[3]})")
    if offset + slices * b0.shape[2] > output.shape[2]:
        raise ValueError(
            f"offset ({offset}) + slices x N ({slices} x {b0.shape[2]}) exceeds output width "
            f"({output.shape[2]})"
        )
    if a0.shape[2] > MAX_RANK:
        raise UnsupportedMoeLoraCall(f"rank {a0.shape[2]} > {MAX_RANK} does not fit on chip")


def fused_moe_lora(
    output: torch.Tensor,
    qcurr_hidden_states: torch.Tensor,
    lora_a_stacked: list[torch.Tensor],
    lora_b_stacked: list[torch.Tensor],
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor | None,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor | None,
    token_lora_mapping: torch.Tensor,
    max_lora_rank: int,
    top_k_num: int,
    lora_ids: torch.Tensor,
    num_active_loras: torch.Tensor,
    adapter_enabled: torch.Tensor,
    shrink_block_size_m: int = 64,
    shrink_block_size_n: int = 64,
    shrink_block_size_k: int = 32,
    shrink_group_size_m: int = 8,
    shrink_num_warps: int = 4,
    shrink_num_stages: int = 3,
    shrink_split_k: int = 1,
    expand_block_size_m: int = 64,
    expand_block_size_n: int = 64,
    expand_block_size_k: int = 32,
    expand_group_size_m: int = 8,
    expand_num_warps: int = 4,
    expand_num_stages: int = 3,
    expand_split_k: int = 1,
    mul_routed_weight: bool = False,
    fully_sharded: bool = False,
    offset: int = 0,
    add_inputs: bool = True,
    config: MoeLoraConfig | None = None,
) -> None:
    """output[pairs, offset + s*N ...] (+)= (x @ A[s].T) @ B[s].T per the reference's spec.

    `config` overrides the tuned lookup (the tuner uses it). Raises UnsupportedMoeLoraCall for
    fully_sharded (it needs a collective between shrink and expand), > 2 slices, rank > 128, or
    where the tuned config says vLLM's kernel wins ("stock").
    """
    if fully_sharded:
        raise UnsupportedMoeLoraCall("fully_sharded needs a collective between shrink and expand")
    x, lora_a, lora_b = qcurr_hidden_states, list(lora_a_stacked), list(lora_b_stacked)
    _check(output, x, lora_a, lora_b, topk_weights, top_k_num, mul_routed_weight, offset)
    del max_lora_rank  # the rank is read off the weights
    a0, b0 = lora_a[0], lora_b[0]
    num_slots, num_experts, rank, k = a0.shape
    n = b0.shape[2]
    num_pairs = topk_weights.numel()
    sorted_form = sorted_token_ids is not None
    if sorted_form:
        assert sorted_token_ids is not None and num_tokens_post_padded is not None
        block_m = shrink_block_size_m
        if block_m < 16 or block_m & (block_m - 1):
            raise ValueError(f"shrink_block_size_m must be a power of 2 >= 16, got {block_m}")
        num_m_blocks = expert_ids.shape[1]
        em = sorted_token_ids.shape[1]
        lora_dim = min(int(num_active_loras.reshape(-1)[0]), lora_ids.numel())
        num_units = _sorted_units(num_pairs, block_m, em, num_m_blocks, lora_dim, num_slots,
                                  num_experts)  # fmt: skip
        stride_sl, stride_el = sorted_token_ids.stride(0), expert_ids.stride(0)
        sorted_arg, ntpp_arg = sorted_token_ids, num_tokens_post_padded
    else:
        block_m, num_m_blocks, em, num_units = NAIVE_BLOCK_M, num_pairs, num_pairs, num_pairs
        stride_sl = stride_el = lora_dim = 0
        # Never dereferenced in the naive form; any int32 tensor stands in for the pointers.
        sorted_arg = ntpp_arg = expert_ids
    if num_units == 0 or n == 0:
        return
    gpu, pdl_ok = _device_info(x.device)
    if config is None:
        key = ShapeKey(k, n, len(lora_a), rank, num_experts, top_k_num, sorted_form, str(x.dtype))
        config = lookup(gpu, key, num_pairs, block_m if sorted_form else None)
    if config.variant == "stock":
        raise UnsupportedMoeLoraCall("tuned: vLLM's own kernel is faster at this shape and batch")
    gemv_flags = [name for name in ("gemv_shrink", "gemv_expand") if getattr(config, name)]
    if gemv_flags and sorted_form:
        verb = "is" if len(gemv_flags) == 1 else "are"
        raise ValueError(f"{' and '.join(gemv_flags)} {verb} for the naive routing form only")
    block_r = max(16, triton.next_power_of_2(rank))
    out2d = output.view(num_pairs, output.shape[2])
    a1 = lora_a[-1]
    b1 = lora_b[-1]
    routing = (sorted_arg, expert_ids, ntpp_arg, token_lora_mapping, lora_ids, adapter_enabled)
    lengths = (num_pairs, top_k_num, num_m_blocks, em, num_units, lora_dim, num_slots)
    lora_pad = max(2, triton.next_power_of_2(lora_ids.numel()))
    token_factor = 1 if mul_routed_weight else top_k_num
    fuse_slices = config.fuse_slices and len(lora_a) == 2  # one program does gate and up
    slice_programs = 1 if fuse_slices else len(lora_a)
    if config.variant == "fused":
        before_output_write()
        grid = (num_units * config.npid, slice_programs)
        kt.moe_lora_fused_kernel[grid](
            x, a0, a1, b0, b1, out2d, topk_weights, *routing, k, n, *lengths, offset,
            x.stride(0), x.stride(1), *a0.stride(), *b0.stride(), *out2d.stride(),
            stride_sl, stride_el,
            TOKEN_FACTOR=token_factor, SORTED=sorted_form, BLOCK_M=block_m, LORA_PAD=lora_pad,
            BLOCK_R=block_r, RANK=rank, BLOCK_K=config.block_k, BLOCK_N=config.block_n,
            NPID=config.npid, EVEN_K=k % config.block_k == 0, MUL_ROUTED_WEIGHT=mul_routed_weight,
            ADD_INPUTS=add_inputs, FUSE_SLICES=fuse_slices, num_stages=config.num_stages,
            **config.launch_options(),
        )  # fmt: skip
        return
    ws_rows = block_m if sorted_form else 1
    split = config.split_k
    ws = torch.empty(
        (len(lora_a), num_units, split, ws_rows, block_r), dtype=torch.float32, device=x.device
    )
    use_pdl = pdl_ok and REGIMES.pdl(num_pairs)
    pdl_kwargs = {"launch_pdl": True} if use_pdl else {}
    if config.gemv_shrink:
        gemv.moe_lora_gemv_shrink_kernel[(num_units, len(lora_a), split)](
            x, a0, a1, ws, expert_ids, token_lora_mapping, adapter_enabled, k, top_k_num,
            num_units, num_slots, x.stride(0), x.stride(1), *a0.stride(),
            TOKEN_FACTOR=token_factor, BLOCK_R=block_r, RANK=rank,
            BLOCK_K=gemv_block_k(k, split), SPLIT_K=split, USE_PDL=use_pdl,
            **config.launch_options(), **pdl_kwargs,
        )  # fmt: skip
    else:
        kt.moe_lora_shrink_kernel[(num_units, slice_programs, split)](
            x, a0, a1, ws, *routing, k, *lengths,
            x.stride(0), x.stride(1), *a0.stride(), stride_sl, stride_el,
            TOKEN_FACTOR=token_factor, SORTED=sorted_form, BLOCK_M=block_m, LORA_PAD=lora_pad,
            BLOCK_R=block_r, RANK=rank, BLOCK_K=config.block_k, SPLIT_K=split,
            EVEN_K=k % (config.block_k * split) == 0, WS_ROWS=ws_rows, USE_PDL=use_pdl,
            FUSE_SLICES=fuse_slices, num_stages=config.num_stages, **config.launch_options(),
            **pdl_kwargs,
        )  # fmt: skip
    expand = SplitExpand(
        ws, b0, b1, out2d, topk_weights, routing, n, lengths, (stride_sl, stride_el), offset,
        sorted_form, block_m, lora_pad, block_r, rank, config,
        _expand_parts(config, sorted_form, block_m), ws_rows, mul_routed_weight, add_inputs,
        torch.cuda.current_stream(x.device) if use_pdl else None,
    )  # fmt: skip
    sink = _deferred_gate_up.get()
    if sink is not None and expand.is_gate_up():
        sink.append(expand)
        return
    before_output_write()
    expand.launch()


@dataclass(frozen=True)
class SplitExpand:
    """The expand half of a split launch, whose shrink has run: the partial products in `ws`
    and everything the expand kernel reads besides. `launch()` adds the LoRA delta into the
    output; `act.expand_silu_and_mul` and `act.expand_swigluoai_and_mul` instead add it on the
    fly into the activation that follows and leave the output as it was."""

    ws: torch.Tensor  # (slices, units, split_k, ws_rows, block_r) fp32 partial products
    b0: torch.Tensor
    b1: torch.Tensor
    out2d: torch.Tensor  # (pairs, columns) view of the op's output
    topk_weights: torch.Tensor
    routing: tuple[torch.Tensor, ...]  # sorted ids, expert ids, ntpp, tlm, lora_ids, enabled
    n: int
    lengths: tuple[int, ...]  # pairs, top_k, m blocks, em, units, lora_dim, slots
    routing_strides: tuple[int, int]  # sorted_token_ids.stride(0), expert_ids.stride(0)
    offset: int
    sorted_form: bool
    block_m: int
    lora_pad: int
    block_r: int
    rank: int
    config: MoeLoraConfig
    parts: int
    ws_rows: int
    mul_routed_weight: bool
    add_inputs: bool
    pdl_stream: torch.cuda.Stream | None  # where the shrink launched under PDL (None: no PDL)

    def pdl_here(self) -> bool:
        """Whether the expand may launch under PDL on the current stream. Its kernel reads the
        output (the GEMM's buffer) before its own wait, trusting the kernel before it in the
        stream, the shrink, to have waited for all work before it: true only on the shrink's
        stream. A shrink that ran beside the GEMM (`vllm/side_stream.py`) left the GEMM as
        the kernel before an expand launched on the main stream."""
        return (
            self.pdl_stream is not None
            and torch.cuda.current_stream(self.ws.device) == self.pdl_stream
        )

    def slices(self) -> int:
        return int(self.ws.shape[0])

    def is_gate_up(self) -> bool:
        """A gate/up call as vLLM's fused experts make it, into an output exactly as wide from
        column 0, added to, not scaled by the routing weights: two slices side by side
        (`FusedMoEWithLoRA`), or one slice of an even width (`FusedMoE3DWithLoRA`, whose w13 B
        holds gate and up in one tensor, GPT-OSS's interleaved). One slice also matches calls
        that are not gate and up (a non-gated MoE's w13): deferring those is safe because the
        activation launches whatever it does not fuse (`vllm/fused_experts.py`)."""
        two = self.slices() == 2 and self.out2d.shape[1] == 2 * self.n
        one = self.slices() == 1 and self.out2d.shape[1] == self.n and self.n % 2 == 0
        return (two or one) and self.offset == 0 and self.add_inputs and not self.mul_routed_weight

    def launch(self) -> None:
        slices = self.ws.shape[0]
        num_units = self.lengths[4]
        config = self.config
        groups = triton.cdiv(triton.cdiv(self.n, config.block_n), config.expand_tiles)
        use_pdl = self.pdl_here()
        pdl_kwargs = {"launch_pdl": True} if use_pdl else {}
        if config.gemv_expand:
            _, expert_ids, _, tlm, _, enabled = self.routing
            gemv.moe_lora_gemv_expand_kernel[(num_units * slices * groups,)](
                self.ws, self.b0, self.b1, self.out2d, self.topk_weights, expert_ids, tlm, enabled,
                self.n, self.lengths[1], num_units, self.lengths[6], self.offset,
                *self.b0.stride(), *self.out2d.stride(),
                BLOCK_R=self.block_r, RANK=self.rank, BLOCK_N=config.block_n,
                SPLIT_K=config.split_k, SLICES=slices, MUL_ROUTED_WEIGHT=self.mul_routed_weight,
                ADD_INPUTS=self.add_inputs, USE_PDL=use_pdl, **config.launch_options(),
                **pdl_kwargs,
            )  # fmt: skip
            return
        # Three stages: the expand's tile loop then loads B two tiles ahead. H200 at 25,600
        # tokens against two stages: Qwen3 down 623.4 -> 612.4 us, GPT-OSS down 592.4 -> 588.7.
        kt.moe_lora_expand_kernel[(num_units * self.parts * slices * groups,)](
            self.ws, self.b0, self.b1, self.out2d, self.topk_weights, *self.routing, self.n,
            *self.lengths, self.offset, *self.b0.stride(), *self.out2d.stride(),
            *self.routing_strides,
            SORTED=self.sorted_form, BLOCK_M=self.block_m, LORA_PAD=self.lora_pad,
            BLOCK_R=self.block_r, RANK=self.rank, BLOCK_N=config.block_n,
            SPLIT_K=config.split_k, WS_ROWS=self.ws_rows, SLICES=slices, PARTS=self.parts,
            TILES=config.expand_tiles, MUL_ROUTED_WEIGHT=self.mul_routed_weight,
            ADD_INPUTS=self.add_inputs, USE_PDL=use_pdl, num_stages=3,
            **config.launch_options(), **pdl_kwargs,
        )  # fmt: skip


# Set only inside `defer_gate_up_expand()`. A context variable, not an argument: vLLM calls the
# op through its own wrappers (PunicaWrapperGPU.add_lora_w13), whose signature we do not own.
_deferred_gate_up: ContextVar[list[SplitExpand] | None] = ContextVar(
    "loraplex_deferred_gate_up", default=None
)


_before_output_write: ContextVar[Callable[[], None] | None] = ContextVar(
    "loraplex_before_output_write", default=None
)


@contextmanager
def defer_gate_up_expand(
    before_output_write: Callable[[], None] | None = None,
) -> Iterator[list[SplitExpand]]:
    """Inside the block, a split gate/up call (`SplitExpand.is_gate_up`) runs its shrink only
    and appends its expand to the yielded list, for the caller to launch or fuse; other calls
    run whole, calling `before_output_write` first (the caller's chance to order the write
    after other work on the output: `vllm/side_stream.py` runs the block on a second stream
    beside the GEMM that writes it). The output is not updated until the caller launches or
    fuses the deferred expands."""
    sink: list[SplitExpand] = []
    token = _deferred_gate_up.set(sink)
    guard = _before_output_write.set(before_output_write)
    try:
        yield sink
    finally:
        _before_output_write.reset(guard)
        _deferred_gate_up.reset(token)


def before_output_write() -> None:
    """What a launch that writes the op's output (ours or vLLM's) calls first, inside
    `defer_gate_up_expand(before_output_write=...)`."""
    if (hook := _before_output_write.get()) is not None:
        hook()


def gemv_block_k(k: int, split: int) -> int:
    """The GEMV shrink's tile width: its whole K range (ranges start at multiples of 64)."""
    return triton.next_power_of_2(triton.cdiv(triton.cdiv(k, split), 64) * 64)


def _expand_parts(config: MoeLoraConfig, sorted_form: bool, block_m: int) -> int:
    """Row parts per sorted block for the expand: the configured count while each part keeps
    the 16 rows tl.dot needs; the naive form's unit is one pair, in one part."""
    parts = config.expand_parts if sorted_form else 1
    while parts > 1 and block_m // parts < 16:
        parts //= 2
    return parts
