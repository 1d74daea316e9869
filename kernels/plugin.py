"""vLLM plugin: our MoE-LoRA op in place of vLLM's `fused_moe_lora`, in every vLLM process.

Registered under the `vllm.general_plugins` entry point (pyproject.toml), which vLLM calls in the
front end, the engine core and every worker it spawns. `register()` is idempotent, never raises,
and logs one line saying what it did:

- on vLLM 0.26 with CUDA it registers `torch.ops.loraplex.fused_moe_lora` (a custom op, so
  torch.compile and CUDA graphs treat it as vLLM's own) and points `PunicaWrapperGPU` at it;
  calls our kernels do not cover (fully_sharded, more than two slices, rank > 128) go to vLLM's
  own implementation;
- switched off, on another vLLM version, or without CUDA it leaves vLLM's kernels in place.

The switch: `register(enabled=...)` from loraplex's engine wrapper, or in processes vLLM spawns
(where loraplex's settings object is not passed) the environment variable
`LORAPLEX_ENGINE__MOE_LORA_KERNELS` (settings field `engine.moe_lora_kernels`), which the
settings layer exports before the engine starts and vLLM's processes inherit. "0", "false", "no"
or "off" turn it off; unset means on.
"""

import enum
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from .moe_lora_op import UnsupportedMoeLoraCall, fused_moe_lora

ENV_SWITCH = "LORAPLEX_ENGINE__MOE_LORA_KERNELS"
SUPPORTED_VLLM = ("0.26.",)
OP_NAME = "loraplex::fused_moe_lora"
_OFF = {"0", "false", "no", "off"}

log = logging.getLogger("loraplex.kernels.plugin")


class PluginState(enum.Enum):
    PATCHED = "patched"  # our op now serves vLLM's MoE-LoRA calls
    ALREADY = "already"  # a previous register() in this process did it
    DISABLED = "disabled"  # switched off
    UNSUPPORTED = "unsupported"  # vLLM version or layout we were not built against
    NO_CUDA = "no_cuda"  # nothing to replace: vLLM's MoE-LoRA kernels run on CUDA only
    FAILED = "failed"  # an unexpected error; vLLM's kernels stay


def _switch_from_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF


def _define_op(original: Callable[..., None]) -> Any:
    """torch.ops.loraplex.fused_moe_lora with vLLM 0.26's schema; `original` is vLLM's eager
    implementation, used for the calls ours does not cover. Defined once per process."""
    if hasattr(torch.ops.loraplex, "fused_moe_lora"):
        return torch.ops.loraplex.fused_moe_lora

    @torch.library.custom_op(OP_NAME, mutates_args=("output",))
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
            original(*args)

    @op.register_fake
    def _fake(*args: object, **kwargs: object) -> None:
        return None

    return torch.ops.loraplex.fused_moe_lora


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
    ours = _define_op(original)
    punica_gpu.fused_moe_lora = ours
    triton_ops.fused_moe_lora = ours
    log.info("loraplex MoE-LoRA kernels: serving vLLM %s fused_moe_lora (pid %d)", version,
             os.getpid())  # fmt: skip
    return PluginState.PATCHED


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
