"""A small in-memory EngineLoraControl for unit tests of the registry's tier logic.

It keeps vLLM's observable contract for the calls the registry makes (add is idempotent, remove
drops the pin, pin needs a loaded id) and counts calls so single flight can be asserted. Tests
that need the real engine start the real server instead.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from loraplex.adapters_registry.base import ServableAdapter


class FakeEngine:
    def __init__(self, load_delay_s: float = 0.0) -> None:
        self.loaded: dict[int, Path] = {}
        self.pinned: set[int] = set()
        self.add_calls = 0
        self.load_delay_s = load_delay_s
        self.pin_delay_s = 0.0
        self.list_delay_s = 0.0  # list_loras answers as of its call, after this delay

    async def add_lora(self, adapter: ServableAdapter) -> None:
        self.add_calls += 1
        if not (adapter.path / "adapter_model.safetensors").is_file():
            raise FileNotFoundError(adapter.path)
        await asyncio.sleep(self.load_delay_s)
        self.loaded[adapter.engine_id] = adapter.path

    async def remove_lora(self, engine_id: int) -> None:
        self.loaded.pop(engine_id, None)
        self.pinned.discard(engine_id)

    async def pin_lora(self, engine_id: int) -> None:
        if engine_id not in self.loaded:
            raise KeyError(engine_id)
        await asyncio.sleep(self.pin_delay_s)
        self.pinned.add(engine_id)

    async def list_loras(self) -> set[int]:
        loaded = set(self.loaded)
        await asyncio.sleep(self.list_delay_s)
        return loaded
