"""What the registry needs from the serving engine: control over vLLM's two adapter tiers.

vLLM keeps adapters in two places: a CPU cache of `max_cpu_loras` loaded adapters (its own LRU) and
`max_loras` GPU slots used by the running batch. The registry decides what is in the CPU cache by
calling `add_lora`/`remove_lora` itself and never asks for more than `max_cpu_loras` at once, so
vLLM's LRU never evicts behind its back. `pin_lora` keeps an adapter in a GPU slot; vLLM has no
unpin: `remove_lora` drops the pin with the adapter.

The server's engine wrapper implements this Protocol (over `AsyncLLM.add_lora` etc.); the registry
never imports the server, so the contract lives here, with `LoraTargets`: which modules the
engine applies LoRA to when it was started with vLLM's `lora_target_modules`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loraplex.adapters_registry.base import ServableAdapter


class EngineLoraControl(Protocol):
    """The engine's adapter tiers. All calls are awaited on the server's event loop.

    Engine ids are the registry's: each one names exactly one version's bytes for the life of the
    catalog, so the engine may cache by id without ever serving stale weights.
    """

    async def add_lora(self, adapter: ServableAdapter) -> None:
        """Load `adapter` (from `adapter.path` on local disk) into the engine's CPU cache.

        Idempotent: adding an id that is already loaded does nothing. Raises on a load failure
        (the registry turns that into AdapterUnavailable naming the adapter).
        """
        ...

    async def remove_lora(self, engine_id: int) -> None:
        """Drop `engine_id` from the engine (CPU cache, GPU slot, pin). Unknown ids: no-op."""
        ...

    async def pin_lora(self, engine_id: int) -> None:
        """Keep the loaded `engine_id` in a GPU slot until it is removed. It must be added first."""
        ...

    async def list_loras(self) -> set[int]:
        """Ids the engine currently holds in its CPU cache (pinned ones included)."""
        ...


@dataclass(frozen=True)
class LoraTargets:
    """The engine's deployment-time LoRA restriction (vLLM's `--lora-target-modules`).

    vLLM then wraps only the modules the list names, yet loads an adapter with LoRA on any module
    the model supports: that module's LoRA is silently not applied. The server builds this from
    the started engine by vLLM's own rule (`loraplex.server.engine.lora_targets`); registration
    refuses an adapter with LoRA on a module `serves` says no to. Without a restriction the
    registry gets None and checks nothing.
    """

    modules: tuple[str, ...]
    """The engine's list as vLLM parsed it (for messages)."""
    serves: Callable[[str], bool]
    """Whether the engine applies LoRA given for a module named as the adapter names it
    (`model.layers.0.self_attn.q_proj`, `model.layers.0.mlp.experts.base_layer`). Pure."""
