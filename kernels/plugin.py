"""vLLM plugin: our MoE-LoRA op in place of vLLM's `fused_moe_lora`, in every vLLM process.

Registered under the `vllm.general_plugins` entry point (pyproject.toml), which vLLM calls in the
front end, the engine core and every worker it spawns. `register()` is idempotent, never raises,
and logs one line saying what it did:

- on vLLM 0.26 with CUDA it registers `torch.ops.loraplex.fused_moe_lora` (registered as vLLM
  registers its own ops, so torch.compile and CUDA graphs treat it as vLLM's) and points
  `PunicaWrapperGPU` at it; calls our kernels do not cover (fully_sharded, more than two
  slices, rank > 128) go to vLLM's own implementation. It also routes
  `PunicaWrapperGPU.add_lora_linear` (attention and other dense layers) through
  `torch.ops.loraplex.lora_linear`: our two-launch GEMV kernels for decode batches of up to
  DENSE_MAX_TOKENS tokens, our tiled kernels for larger ones; and it builds the MoE-LoRA routing
  (vLLM's `moe_lora_align_block_size`) with our kernels from ALIGN_MIN_PAIRS (token, expert)
  pairs on, and asks for the naive routing form (no align at all) while pairs <= experts x
  max_loras, up to 1,024 pairs and, under vLLM's specialize_active_lora, 4 per (active
  adapter, expert) (`moe_lora_configs.serves_naive`), where vLLM sorts from an eighth of that,
  and for sorted blocks of 16 to 64 rows where vLLM's config asks for larger ones but the pairs
  average at most 32 per (slot, expert) (`moe_lora_configs.serves_block_m`);
  and it builds each step's LoRA batch metadata on the host (`lora_mapping`), where
  vLLM's waits for the device; and in vLLM's Triton fused experts it adds the gate/up LoRA
  inside SiLU-and-mul (`moe_act_fusion`), not into the buffer SiLU-and-mul reads, and at
  prefill sizes and in CUDA graphs runs the MoE LoRA on a side stream beside the base GEMMs:
  the gate/up routing and shrink beside the gate/up GEMM, the down LoRA beside the down GEMM,
  its delta added by moe_sum (`moe_lora_side_stream`);
- it warms the LoRA paths up at prefill sizes before vLLM captures its CUDA graphs (see
  `warm_up_sizes`), so that no Triton kernel, ours or vLLM's, compiles while serving;
- switched off, on another vLLM version, or without CUDA it leaves vLLM's kernels in place.

The switch: `register(enabled=...)` from loraplex's engine wrapper, or in processes vLLM spawns
(where loraplex's settings object is not passed) the environment variable
`LORAPLEX_ENGINE__MOE_LORA_KERNELS` (settings field `engine.moe_lora_kernels`), which the
settings layer exports before the engine starts and vLLM's processes inherit. "0", "false", "no"
or "off" turn it off; unset means on.
"""

# The kernel modules are imported only when registering: importing this module (as the server
# does) must not create Triton kernels, which pick compiled or interpreted mode at creation.
import enum
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

ENV_SWITCH = "LORAPLEX_ENGINE__MOE_LORA_KERNELS"
SUPPORTED_VLLM = ("0.26.",)
OP_NAME = "loraplex::fused_moe_lora"
DENSE_OP_NAME = "loraplex::lora_linear"
ALIGN_OP_NAME = "loraplex::moe_lora_align_block_size"
# Our per-token dense kernels (GEMVs) serve batches up to this size (vLLM captures decode CUDA
# graphs up to max_num_seqs); larger ones go to our tiled kernels.
DENSE_MAX_TOKENS = 64
# vLLM's align op serves batches below this many (token, expert) pairs, ours the larger ones.
# H200 (bench_lora_prefill): Qwen3 routing, 2,048 pairs 16.4 vs 15.1 us, 131,072 pairs 497 vs
# 45 us (vLLM sorts each slot's pairs in one thread block); 512 pairs 9.8 vs 13.2 us.
ALIGN_MIN_PAIRS = 2048
_OFF = {"0", "false", "no", "off"}
# Our key in vLLM's `additional_config` (see compile_cache_config).
COMPILE_CACHE_KEY = "loraplex_moe_lora_kernels"
# Prefill-sized batches start here; smaller ones are vLLM's CUDA-graph sizes, which it captures
# with LoRA active and so compiles for already.
WARM_UP_FIRST_TOKENS = 64

# Under vLLM's logger tree, so that the line shows in the engine core's and the workers' output:
# vLLM configures handlers for "vllm" only, and a bare logger of ours would print nothing at INFO.
log = logging.getLogger("vllm.plugins.loraplex_moe_lora")


class PluginState(enum.Enum):
    PATCHED = "patched"  # our op now serves vLLM's MoE-LoRA calls
    ALREADY = "already"  # a previous register() in this process did it
    DISABLED = "disabled"  # switched off
    UNSUPPORTED = "unsupported"  # vLLM version or layout we were not built against
    NO_CUDA = "no_cuda"  # nothing to replace: vLLM's MoE-LoRA kernels run on CUDA only
    FAILED = "failed"  # an unexpected error; vLLM's kernels stay


def _switch_from_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF


def compile_cache_config(enabled: bool) -> dict[str, str]:
    """The switch as an entry of vLLM's `additional_config`, which vLLM hashes into the key of
    its torch.compile cache. Engines must pass it.

    The compiled graph records the LoRA ops that dynamo traced (ours or vLLM's), but vLLM keys
    its cache by config and checks only that the traced source files are unchanged. The
    plugin changes no source file, so without this entry an engine loads whichever graph was
    compiled first for the same config. On the H200 a plugin run started after a stock run
    loaded the stock graph: vLLM's dense LoRA kernels ran again, and decode fell to 58 tok/s
    per request from 65 in that session's run that compiled its own graph."""
    return {COMPILE_CACHE_KEY: "on" if enabled else "off"}


_LIBRARY: list[Any] = []  # the torch.library.Library our ops live in, kept alive with the process


def _register_op(qualified: str, fn: Callable[..., None], mutates_args: tuple[str, ...]) -> Any:
    """The op `qualified` ("loraplex::name") with `fn`'s schema, dispatched straight to `fn` on
    CUDA, and a no-op fake for torch.compile; vLLM registers its own ops so too
    (`direct_register_custom_op`).

    Not torch.library.custom_op: each call of one goes through Python dispatch layers (an
    ADInplaceOrView kernel, a dynamo-disabled wrapper, alias checks), and a prefill of 16 x 1600
    tokens makes 480 calls of our three ops. On the H200 (bench_e2e.py --profile host, engine in
    process) those layers were the host's largest self time under cProfile, and are gone from
    it now; the prefill's wall did not move (median 0.49 s before, 0.50 s after), because the
    host now reached vLLM's step-start sync (LoRAKernelMeta.prepare_tensors) sooner and waited
    there instead; `lora_mapping` removes that sync."""
    name = qualified.split("::")[1]
    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library("loraplex", "FRAGMENT"))
    library = _LIBRARY[0]
    library.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
    library.impl(name, fn, "CUDA")
    library._register_fake(name, lambda *args, **kwargs: None)
    return getattr(torch.ops.loraplex, name)


def _define_op(original: Callable[..., None]) -> Any:
    """torch.ops.loraplex.fused_moe_lora with vLLM 0.26's schema; `original` is vLLM's eager
    implementation, used for the calls ours does not cover. Defined once per process."""
    if hasattr(torch.ops.loraplex, "fused_moe_lora"):
        return torch.ops.loraplex.fused_moe_lora
    from loraplex.kernels.moe_lora_op import (
        UnsupportedMoeLoraCall,
        before_output_write,
        fused_moe_lora,
    )

    def op(
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
        shrink_block_size_m: int,
        shrink_block_size_n: int,
        shrink_block_size_k: int,
        shrink_group_size_m: int,
        shrink_num_warps: int,
        shrink_num_stages: int,
        shrink_split_k: int,
        expand_block_size_m: int,
        expand_block_size_n: int,
        expand_block_size_k: int,
        expand_group_size_m: int,
        expand_num_warps: int,
        expand_num_stages: int,
        expand_split_k: int,
        mul_routed_weight: bool = False,
        fully_sharded: bool = False,
        offset: int = 0,
        add_inputs: bool = True,
    ) -> None:
        args = (
            output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights,
            sorted_token_ids, expert_ids, num_tokens_post_padded, token_lora_mapping,
            max_lora_rank, top_k_num, lora_ids, num_active_loras, adapter_enabled,
            shrink_block_size_m, shrink_block_size_n, shrink_block_size_k, shrink_group_size_m,
            shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m,
            expand_block_size_n, expand_block_size_k, expand_group_size_m, expand_num_warps,
            expand_num_stages, expand_split_k, mul_routed_weight, fully_sharded, offset,
            add_inputs,
        )  # fmt: skip
        try:
            fused_moe_lora(*args)
        except UnsupportedMoeLoraCall:
            before_output_write()
            original(*args)

    return _register_op(OP_NAME, op, mutates_args=("output",))


def _define_dense_op(shrink: Callable[..., None], expand: Callable[..., None]) -> Any:
    """torch.ops.loraplex.lora_linear: `PunicaWrapperGPU.add_lora_linear`'s work as one op: our
    per-token kernels for decode batches, our tiled ones for prefill batches, vLLM's `shrink` and
    `expand` (its eager implementations) for layouts ours do not take.

    The LoRA runs after its base GEMM, on the main stream. Starting the prefill shrink beside
    the GEMM on the MoE side stream (e84b910: the GEMM and the LoRA as one op) lost on the H200
    in two interleaved A/Bs: prefill 0.4464 and 0.4497 s against 0.4405 and 0.4435 s, decode
    66.63 and 66.61 against 66.89 and 67.03 tok/s per request (bench/e2e rows e84b910-ab*).
    The decode shrink beside the GEMM (6b45a17, in CUDA graphs; the expand after the join, so
    no longer under PDL) lost too: 66.33 and 66.00 against 66.95 and 66.91 tok/s per request,
    interleaved on one H200 (rows 6b45a17-ab*, 839ce7f-ab*). Not profiled; the likely cause is
    that the expand, launched after the join, no longer had its launch hidden by PDL, and that
    cost more than the shrink's time taken off the main stream."""
    if hasattr(torch.ops.loraplex, "lora_linear"):
        return torch.ops.loraplex.lora_linear
    from loraplex.kernels.lora_dense_op import UnsupportedDenseCall, lora_dense
    from loraplex.kernels.lora_dense_tiled import lora_dense_tiled

    def op(
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
        scale: float,
        token_lora_mapping: torch.Tensor,
        token_indices_sorted_by_lora_ids: torch.Tensor,
        num_tokens_per_lora: torch.Tensor,
        lora_token_start_loc: torch.Tensor,
        lora_ids: torch.Tensor,
        no_lora_flag_cpu: torch.Tensor,
        num_active_loras: torch.Tensor,
        add_inputs: bool,
    ) -> None:
        if bool(no_lora_flag_cpu.item()):  # a CPU tensor by vLLM's contract: no device sync
            return
        try:
            if x.shape[0] <= DENSE_MAX_TOKENS:
                lora_dense(y, x, lora_a, lora_b, token_lora_mapping, scale, add_inputs)
            else:
                lora_dense_tiled(
                    y, x, lora_a, lora_b, scale, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, add_inputs,
                )  # fmt: skip
            return
        except UnsupportedDenseCall:
            pass
        meta = (token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras)  # fmt: skip
        rank = lora_b[0].shape[-1]
        buffer = torch.empty((len(lora_a), x.shape[0], rank), dtype=torch.float32, device=x.device)
        shrink(x, lora_a, buffer, *meta, scale)
        expand(buffer, lora_b, y, *meta, offset_start=0, add_inputs=add_inputs)

    return _register_op(DENSE_OP_NAME, op, mutates_args=("y",))


def _define_align_op(original: Callable[..., None]) -> Any:
    """torch.ops.loraplex.moe_lora_align_block_size with the schema of vLLM 0.26's
    `_custom_ops.moe_lora_align_block_size`: ours from ALIGN_MIN_PAIRS pairs on, `original`
    (vLLM's) for smaller batches and under expert parallelism (an expert map)."""
    if hasattr(torch.ops.loraplex, "moe_lora_align_block_size"):
        return torch.ops.loraplex.moe_lora_align_block_size
    from loraplex.kernels.moe_lora_align import BLOCK_SIZES, moe_lora_align_block_size

    def op(
        topk_ids: torch.Tensor,
        token_lora_mapping: torch.Tensor,
        num_experts: int,
        block_size: int,
        max_loras: int,
        max_num_tokens_padded: int,
        max_num_m_blocks: int,
        sorted_token_ids: torch.Tensor,
        experts_ids: torch.Tensor,
        num_tokens_post_pad: torch.Tensor,
        adapter_enabled: torch.Tensor,
        lora_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
    ) -> None:
        ours = (expert_map is None and block_size in BLOCK_SIZES
                and topk_ids.numel() >= ALIGN_MIN_PAIRS)  # fmt: skip
        if ours:
            moe_lora_align_block_size(
                topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                num_tokens_post_pad, adapter_enabled,
            )  # fmt: skip
            return
        original(topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                 max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                 num_tokens_post_pad, adapter_enabled, lora_ids, expert_map)  # fmt: skip

    mutated = ("sorted_token_ids", "experts_ids", "num_tokens_post_pad")
    return _register_op(ALIGN_OP_NAME, op, mutates_args=mutated)


def _add_lora_linear(
    self: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: tuple[torch.Tensor, ...],
    lora_b_stacked: tuple[torch.Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    *,
    buffer: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """PunicaWrapperGPU.add_lora_linear (vLLM 0.26 semantics) through torch.ops.loraplex."""
    del output_slices, buffer  # widths come from B's shapes, as in vLLM's expand; no buffer
    x2 = x.view(-1, x.shape[-1])
    meta = self.token_mapping_meta.meta_args(x2.size(0), self.lora_config.specialize_active_lora)
    torch.ops.loraplex.lora_linear(
        y.view(-1, y.shape[-1]), x2, list(lora_a_stacked), list(lora_b_stacked), float(scale),
        *meta, bool(kwargs.get("add_inputs", True)),
    )  # fmt: skip


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Token counts for LoRA-active dummy steps, largest first: a ladder of sqrt(2) steps from
    WARM_UP_FIRST_TOKENS to `max_tokens`, each also plus one.

    vLLM warms LoRA up only at decode sizes (its CUDA-graph capture). On the H200 every run then
    JIT-compiled LoRA kernels in its first prefill-sized steps while serving, vLLM's and ours
    (its jit_monitor said so), and one run stalled 2.3 s. Kernel configs are chosen by size
    ranges (ours by pair count, vLLM's by token count), so the ladder reaches every range; the
    odd neighbour covers Triton's specialisation of integer arguments on divisibility by 16.
    """
    steps = int(math.log2(max_tokens / WARM_UP_FIRST_TOKENS) * 2) + 1 if max_tokens > 0 else 0
    ladder = {int(WARM_UP_FIRST_TOKENS * 2 ** (i / 2)) for i in range(steps)} | {max_tokens}
    sizes = {n for n in ladder if n <= max_tokens} | {n + 1 for n in ladder if n < max_tokens}
    return sorted(sizes, reverse=True)


def warm_up_rows(max_rows: int) -> list[int]:
    """Sampled-row counts for the LoRA on the logits (vLLM's `add_lora_logits`, which runs
    eagerly every step): one row, a multiple of 16 and neither (Triton's specialisations), on
    both sides of the 128 rows where vLLM's default shrink config changes. One row came up on
    the H200: a step where a single request finishes its prompt samples one row."""
    return sorted(n for n in {1, 2, 16, 128, 129, 144} if n <= max_rows)


def _warm_up_lora(runner: Any, max_tokens: int, max_rows: int) -> None:
    """LoRA-active dummy steps over `warm_up_sizes`, with every LoRA slot active and with one
    (vLLM's MoE-LoRA kernel takes the active count as an integer argument, which Triton
    specialises when it is 1), then logits over `warm_up_rows`. A failure is logged, never
    raised.

    Measured on the H200 (issue 6 workload, 16,384-token budget): 40 s more at start; Triton
    compiles while serving went from 3 (this ladder with all slots only) to 0, and the plugin's
    repetitions from 57-64 to 63-65 tok/s per request."""
    lora_config = getattr(runner, "lora_config", None)
    if lora_config is None:
        return
    from vllm.config import CUDAGraphMode

    start = time.perf_counter()
    sizes, rows = warm_up_sizes(max_tokens), warm_up_rows(max_rows)

    def step(tokens: int, active: int) -> Any:
        # Dummy LoRAs stay in between; vLLM's own warm-up removes them after.
        return runner._dummy_run(
            tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE, skip_eplb=True, remove_lora=False,
            num_active_loras=active,
        )  # fmt: skip

    try:
        for active in sorted({lora_config.max_loras, 1}, reverse=True):
            for n in sizes:
                step(n, active)
        for n in rows:
            _, last_hidden_states = step(n, min(n, lora_config.max_loras))
            runner.model.compute_logits(last_hidden_states)
    except Exception:
        log.exception("loraplex MoE-LoRA kernels: LoRA warm-up failed; serving goes on")
        return
    log.info("loraplex MoE-LoRA kernels: LoRA warm-up of %d prefill sizes (%d..%d tokens) and "
             "%d logits row counts in %.1f s", len(sizes), sizes[-1], sizes[0], len(rows),
             time.perf_counter() - start)  # fmt: skip


def _patch_warm_up() -> None:
    """Run `_warm_up_lora` at the start of vLLM's worker warm-up, before graph capture."""
    from vllm.v1.worker import gpu_worker

    original = gpu_worker.Worker.compile_or_warm_up_model
    if getattr(original, "_loraplex_warm_up", False):
        return

    @functools.wraps(original)
    def compile_or_warm_up_model(self: Any) -> Any:
        scheduler = self.scheduler_config
        _warm_up_lora(self.model_runner, scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        return original(self)

    compile_or_warm_up_model._loraplex_warm_up = True  # type: ignore[attr-defined]
    gpu_worker.Worker.compile_or_warm_up_model = compile_or_warm_up_model  # type: ignore[method-assign]


def _patch() -> PluginState:
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if not version.startswith(SUPPORTED_VLLM):
        log.warning(
            "loraplex MoE-LoRA kernels: vLLM %s is not supported (built for %s); "
            "vLLM's own kernels stay",
            version,
            ", ".join(v + "x" for v in SUPPORTED_VLLM),
        )
        return PluginState.UNSUPPORTED
    if not torch.cuda.is_available():
        log.info("loraplex MoE-LoRA kernels: no CUDA device; vLLM's own kernels serve")
        return PluginState.NO_CUDA
    import vllm.lora.ops.triton_ops as triton_ops
    from vllm.lora.ops.triton_ops import fused_moe_lora_op
    from vllm.lora.punica_wrapper import punica_gpu

    current = getattr(punica_gpu, "fused_moe_lora", None)
    if getattr(current, "_qualified_op_name", None) == OP_NAME:
        return PluginState.ALREADY
    original = getattr(fused_moe_lora_op, "_fused_moe_lora", None)
    if current is None or original is None:
        log.warning("loraplex MoE-LoRA kernels: vLLM %s lacks fused_moe_lora; stock kernels stay",
                    version)  # fmt: skip
        return PluginState.UNSUPPORTED
    from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op

    from loraplex.kernels.lora_mapping import update_metadata
    from loraplex.kernels.moe_act_fusion import patch_triton_experts

    # First and on its own: engine.specialize_active_lora is safe only with this metadata
    # (`lora_mapping.fill_kernel_meta`), so it stays in place if a later step fails.
    punica_gpu.PunicaWrapperGPU.update_metadata = update_metadata  # type: ignore[method-assign]
    ours = _define_op(original)
    _define_dense_op(lora_shrink_op._lora_shrink, lora_expand_op._lora_expand)
    align = _define_align_op(punica_gpu.ops.moe_lora_align_block_size)
    punica_gpu.fused_moe_lora = ours
    triton_ops.fused_moe_lora = ours
    # punica_gpu calls it as `ops.moe_lora_align_block_size`, looked up on each call.
    punica_gpu.ops.moe_lora_align_block_size = align
    punica_gpu.PunicaWrapperGPU.add_lora_linear = _add_lora_linear  # type: ignore[method-assign]
    wrapper = punica_gpu.PunicaWrapperGPU
    wrapper.moe_lora_align_block_size = _routing_for_our_kernels(  # type: ignore[method-assign]
        wrapper.moe_lora_align_block_size
    )
    wrapper.add_lora_fused_moe = _configs_at_aligned_block(  # type: ignore[method-assign]
        wrapper.add_lora_fused_moe
    )
    patch_triton_experts()
    _patch_warm_up()
    log.info("loraplex MoE-LoRA kernels: serving vLLM %s fused_moe_lora (its gate/up expand "
             "fused into SiLU-and-mul, beside the base GEMMs at prefill and in CUDA graphs), "
             "add_lora_linear, moe_lora_align_block_size and the LoRA "
             "batch metadata (pid %d)", version, os.getpid())  # fmt: skip
    return PluginState.PATCHED


# On the PunicaWrapperGPU: (address of the sorted ids, block) of the routing its wrapped align last
# built at another block size than vLLM's config asked for, else None; read back by the wrapped
# add_lora_fused_moe. By address, not an attribute on the tensor: both calls of a layer get views
# of it, and under inference mode (vLLM's forward) a view keeps no link to the tensor it views.
ALIGNED_ATTR = "_loraplex_aligned"


def _routing_for_our_kernels(align: Callable[..., Any]) -> Callable[..., Any]:
    """PunicaWrapperGPU.moe_lora_align_block_size that asks for the routing form our kernels are
    fastest in: the naive form (no align kernel, one program per pair) where vLLM would sort
    (`moe_lora_configs.serves_naive`), and in the sorted form smaller blocks than vLLM's config
    (`moe_lora_configs.serves_block_m`; the wrapper remembers the block, ALIGNED_ATTR, for
    `_configs_at_aligned_block`). Both stay vLLM's under expert parallelism (expert_map: vLLM's
    naive form has no map from global to local experts), with fully sharded LoRA or ranks over
    MAX_RANK (our op declines those calls, and vLLM's kernel was not timed in our forms)."""
    from loraplex.kernels.moe_lora_configs import serves_block_m, serves_naive
    from loraplex.kernels.moe_lora_op import MAX_RANK

    @functools.wraps(align)
    def moe_lora_align_block_size(
        self: Any,
        topk_ids: torch.Tensor,
        num_tokens: int,
        block_size: int,
        num_experts: int,
        max_loras: int,
        adapter_enabled: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        pad_sorted_ids: bool = False,
        naive_block_assignment: bool = False,
        token_lora_mapping: torch.Tensor | None = None,
    ) -> Any:
        config = self.lora_config
        ours = not config.fully_sharded_loras and config.max_lora_rank <= MAX_RANK
        vllm_block = block_size
        if expert_map is None and ours:
            pairs = topk_ids.numel()
            naive_block_assignment = serves_naive(
                pairs, num_experts, max_loras, naive_block_assignment, _active_loras(self)
            )
            block_size = serves_block_m(pairs, num_experts, max_loras, block_size)
        routing = align(self, topk_ids, num_tokens, block_size, num_experts, max_loras,
                        adapter_enabled, expert_map, pad_sorted_ids, naive_block_assignment,
                        token_lora_mapping)  # fmt: skip
        sorted_ids = routing[1]
        changed = sorted_ids is not None and block_size != vllm_block
        setattr(self, ALIGNED_ATTR, (sorted_ids.data_ptr(), block_size) if changed else None)
        return routing

    return moe_lora_align_block_size


def _active_loras(punica: Any) -> int | None:
    """How many adapters the batch being routed holds, where vLLM captures a CUDA graph per
    count (specialize_active_lora: the count is then rounded up to the graph's, and
    `lora_mapping.fill_kernel_meta` counts adapters only); else None. Without that setting a
    graph replays the form chosen at its capture for every count, and vLLM rounds every count
    up to max_loras + 1 anyway."""
    if not punica.lora_config.specialize_active_lora:
        return None
    count = int(punica.token_mapping_meta.num_active_loras_cpu[0])
    return count if count > 0 else None


def aligned_block(punica: Any, sorted_token_ids: torch.Tensor | None) -> int | None:
    """The block size `_routing_for_our_kernels` last aligned routing to on this wrapper, where
    it was not vLLM's and these sorted ids (or a view of them) are that routing; else None."""
    aligned = getattr(punica, ALIGNED_ATTR, None)
    if sorted_token_ids is None or aligned is None:
        return None
    address, block = aligned
    return int(block) if sorted_token_ids.data_ptr() == address else None


def _configs_at_aligned_block(add_lora_fused_moe: Callable[..., Any]) -> Callable[..., Any]:
    """PunicaWrapperGPU.add_lora_fused_moe (gate/up and down) with BLOCK_SIZE_M of both configs
    set to the block the routing was aligned to, where `_routing_for_our_kernels` chose it:
    the kernels, ours or vLLM's, read the sorted ids in blocks of that size."""

    @functools.wraps(add_lora_fused_moe)
    def add(
        self: Any,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        topk_weights: torch.Tensor,
        sorted_token_ids: torch.Tensor | None,
        expert_ids: torch.Tensor,
        num_tokens_post_padded: torch.Tensor | None,
        max_lora_rank: int,
        top_k_num: int,
        shrink_config: dict[str, Any],
        expand_config: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        block = aligned_block(self, sorted_token_ids)
        if block is not None:
            shrink_config = {**shrink_config, "BLOCK_SIZE_M": block}
            expand_config = {**expand_config, "BLOCK_SIZE_M": block}
        return add_lora_fused_moe(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights,
                                  sorted_token_ids, expert_ids, num_tokens_post_padded,
                                  max_lora_rank, top_k_num, shrink_config, expand_config, *args,
                                  **kwargs)  # fmt: skip

    return add


def register(enabled: bool | None = None) -> PluginState:
    """Put our MoE-LoRA op in place of vLLM's in this process (see the module docstring).

    enabled: the settings switch; None reads LORAPLEX_ENGINE__MOE_LORA_KERNELS (unset = on).
    Safe to call any number of times; never raises.
    """
    if not (_switch_from_env() if enabled is None else enabled):
        log.info("loraplex MoE-LoRA kernels: switched off (%s); vLLM's own kernels serve",
                 ENV_SWITCH)  # fmt: skip
        return PluginState.DISABLED
    try:
        return _patch()
    except Exception:
        log.exception("loraplex MoE-LoRA kernels: registration failed; vLLM's own kernels serve")
        return PluginState.FAILED
