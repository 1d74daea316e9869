"""LoRA warm-up at prefill sizes, run at the start of vLLM's worker warm-up (before it captures
its CUDA graphs), so that no Triton kernel, ours or vLLM's, compiles while serving.

vLLM warms LoRA up only at decode sizes (its CUDA-graph capture). On the H200 every run then
JIT-compiled LoRA kernels in its first prefill-sized steps while serving, vLLM's and ours (its
jit_monitor said so), and one run stalled 2.3 s.
"""

import functools
import math
import time
from typing import Any

from loraplex.kernels.vllm.plugin import log

# Prefill-sized batches start here; smaller ones are vLLM's CUDA-graph sizes, which it captures
# with LoRA active and so compiles for already.
WARM_UP_FIRST_TOKENS = 64


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Token counts for LoRA-active dummy steps, largest first: a ladder of sqrt(2) steps from
    WARM_UP_FIRST_TOKENS to `max_tokens`, each also plus one.

    Kernel configs are chosen by size ranges (ours by pair count, vLLM's by token count), so the
    ladder reaches every range; the odd neighbour covers Triton's specialisation of integer
    arguments on divisibility by 16.
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


def patch_warm_up() -> None:
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
