"""vLLM plugin: our LoRA kernels in place of vLLM's, in every vLLM process.

Registered under the `vllm.general_plugins` entry point (pyproject.toml), which vLLM calls in the
front end, the engine core and every worker it spawns. `register()` is idempotent, never raises,
and logs one line saying what it did:

- on vLLM 0.26 with CUDA it defines our ops (`custom_ops`: registered as vLLM registers its
  own, so torch.compile and CUDA graphs treat them as vLLM's) and points vLLM at them, with
  vLLM's own implementation for the calls ours do not cover (fully sharded, more than two
  slices, rank > 128): the MoE LoRA (`fused_moe_lora`), the dense LoRA (`add_lora_linear`) and
  the sorted routing's align (`punica`, in the forms `kernels/dispatch.py` picks); it builds
  each step's LoRA batch metadata on the host (`batch_metadata`), fuses the gate/up LoRA into
  vLLM's SiLU-and-mul and runs the MoE LoRA beside the base GEMMs at prefill sizes
  (`fused_experts`, `side_stream`), and warms the LoRA paths up at prefill sizes (`warm_up`).
  The package docstring lists every vLLM attribute replaced. A GPU worker that runs vLLM's V2
  model runner (0.26's default for dense models) puts vLLM's back before it builds the runner,
  and says so (`runner_guard`: our kernels are built for the V1 runner);
- switched off, on another vLLM version, or without CUDA it leaves vLLM's kernels in place.

Whatever the switch, vLLM version and platform, it first installs the isolation patches
(`lora_slot_hygiene`, `kv_cache_hygiene`: docs/isolation.md), which replace no kernel.

The switch: `register(enabled=...)` from loraplex's engine wrapper, or in processes vLLM spawns
(where loraplex's settings object is not passed) the environment variable
`LORAPLEX_ENGINE__MOE_LORA_KERNELS` (settings field `engine.moe_lora_kernels`), which the
settings layer exports before the engine starts and vLLM's processes inherit. "0", "false", "no"
or "off" turn it off; unset means on.
"""

# The kernel modules are imported only when registering: importing this module (as the server
# does) must not create Triton kernels, which pick compiled or interpreted mode at creation.
import enum
import logging
import os

import torch

ENV_SWITCH = "LORAPLEX_ENGINE__MOE_LORA_KERNELS"
SUPPORTED_VLLM = ("0.26.",)
_OFF = {"0", "false", "no", "off"}
# Our key in vLLM's `additional_config` (see compile_cache_config).
COMPILE_CACHE_KEY = "loraplex_moe_lora_kernels"

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

    from loraplex.kernels.vllm.custom_ops import OP_NAME

    current = getattr(punica_gpu, "fused_moe_lora", None)
    if getattr(current, "_qualified_op_name", None) == OP_NAME:
        return PluginState.ALREADY
    original = getattr(fused_moe_lora_op, "_fused_moe_lora", None)
    if current is None or original is None:
        log.warning("loraplex MoE-LoRA kernels: vLLM %s lacks fused_moe_lora; stock kernels stay",
                    version)  # fmt: skip
        return PluginState.UNSUPPORTED
    from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.v1.worker import gpu_worker

    from loraplex.kernels.vllm import runner_guard
    from loraplex.kernels.vllm.batch_metadata import update_metadata
    from loraplex.kernels.vllm.custom_ops import (
        define_align_op,
        define_dense_op,
        define_moe_lora_op,
    )
    from loraplex.kernels.vllm.fused_experts import METHODS, patch_triton_experts
    from loraplex.kernels.vllm.punica import (
        add_lora_linear,
        configs_at_aligned_block,
        routing_for_our_kernels,
    )
    from loraplex.kernels.vllm.warm_up import patch_warm_up

    wrapper = punica_gpu.PunicaWrapperGPU
    # vLLM's attributes before any is replaced, for a worker on the V2 runner to put back.
    metadata = runner_guard.Originals().save(wrapper, "update_metadata")
    kernels = (
        runner_guard.Originals()
        .save(punica_gpu, "fused_moe_lora")
        .save(triton_ops, "fused_moe_lora")
        .save(punica_gpu.ops, "moe_lora_align_block_size")
        .save(wrapper, "add_lora_linear", "moe_lora_align_block_size", "add_lora_fused_moe")
        .save(TritonExperts, *METHODS)
        .save(gpu_worker.Worker, "compile_or_warm_up_model")
    )
    # First and on its own: engine.specialize_active_lora is safe only with this metadata
    # (`batch_metadata.fill_kernel_meta`), so it stays in place if a later step fails.
    wrapper.update_metadata = update_metadata  # type: ignore[method-assign]
    ours = define_moe_lora_op(original)
    define_dense_op(lora_shrink_op._lora_shrink, lora_expand_op._lora_expand)
    align = define_align_op(punica_gpu.ops.moe_lora_align_block_size)
    punica_gpu.fused_moe_lora = ours
    triton_ops.fused_moe_lora = ours
    # punica_gpu calls it as `ops.moe_lora_align_block_size`, looked up on each call.
    punica_gpu.ops.moe_lora_align_block_size = align
    wrapper.add_lora_linear = add_lora_linear  # type: ignore[method-assign]
    wrapper.moe_lora_align_block_size = routing_for_our_kernels(  # type: ignore[method-assign]
        wrapper.moe_lora_align_block_size
    )
    wrapper.add_lora_fused_moe = configs_at_aligned_block(  # type: ignore[method-assign]
        wrapper.add_lora_fused_moe
    )
    patch_triton_experts()
    patch_warm_up()
    runner_guard.install(gpu_worker.Worker, kernels, metadata)
    log.info("loraplex MoE-LoRA kernels: serving vLLM %s fused_moe_lora (its gate/up expand "
             "fused into SiLU-and-mul, beside the base GEMMs at prefill, in order at decode), "
             "add_lora_linear, moe_lora_align_block_size and the LoRA batch metadata (pid %d)",
             version, os.getpid())  # fmt: skip
    return PluginState.PATCHED


def _install_isolation() -> None:
    """The isolation patches, each on its own: a failure is logged and leaves the others."""
    from loraplex.kernels.vllm import kv_cache_hygiene, lora_slot_hygiene

    for patch in (lora_slot_hygiene, kv_cache_hygiene):
        try:
            patch.install()
        except Exception:
            log.exception("loraplex isolation patch %s failed; vLLM's code stays", patch.__name__)
            continue
        log.info("loraplex isolation patch %s installed (pid %d)", patch.__name__, os.getpid())


def register(enabled: bool | None = None) -> PluginState:
    """Put our MoE-LoRA op in place of vLLM's in this process (see the module docstring).

    enabled: the settings switch; None reads LORAPLEX_ENGINE__MOE_LORA_KERNELS (unset = on).
    Safe to call any number of times; never raises.
    """
    _install_isolation()
    if not (_switch_from_env() if enabled is None else enabled):
        log.info("loraplex MoE-LoRA kernels: switched off (%s); vLLM's own kernels serve",
                 ENV_SWITCH)  # fmt: skip
        return PluginState.DISABLED
    try:
        return _patch()
    except Exception:
        log.exception("loraplex MoE-LoRA kernels: registration failed; vLLM's own kernels serve")
        return PluginState.FAILED
