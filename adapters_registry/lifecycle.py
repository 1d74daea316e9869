"""Opening the registry in the server's lifespan.

    async with open_adapter_source(
        settings.registry, engine, model_dir=..., base_model_name=..., max_lora_rank=...,
        max_loras=..., max_cpu_loras=..., cache_root=settings.cache_dir / "adapters",
        seed_dir=demo_adapters_dir,  # optional: registered at start if settings has no local_dir
    ) as registry:
        ...  # registry.lease(name) / registry.names() for the gateway, the rest for admin routes

Start-up reads the base model's config and safetensors headers, rebuilds the disk cache index from
disk, reads the catalog (snapshot + log tail), removes what killed processes left in the store and
the disk cache (`cleanup`), registers the adapters of `registry.local_dir` (or `seed_dir`, leaving
out any the registry refuses; idempotent: unchanged ones are already there), then polls the store
every `registry.poll_interval_s` for other replicas' changes until the block exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NotRequired, TypedDict, Unpack

from prometheus_client import REGISTRY, CollectorRegistry

from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.base import AdapterError, AdapterInvalid
from loraplex.adapters_registry.base_model import load_base_model_spec
from loraplex.adapters_registry.catalog import Catalog
from loraplex.adapters_registry.catalog_sync import CatalogSync
from loraplex.adapters_registry.cleanup import sweep_leftovers
from loraplex.adapters_registry.disk_cache import DiskCache
from loraplex.adapters_registry.engine import EngineLoraControl, LoraTargets
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.names import check_new_name
from loraplex.adapters_registry.pins import PinLimit
from loraplex.adapters_registry.quarantine import Quarantines
from loraplex.adapters_registry.registration import Registrar
from loraplex.adapters_registry.registry import AdapterRegistry
from loraplex.adapters_registry.residency import Residency
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.store import open_store
from loraplex.adapters_registry.tiers import EngineTiers
from loraplex.adapters_registry.validation import CONFIG_FILE

log = logging.getLogger(__name__)


class RegistryShape(TypedDict):
    """What a registry is built for: the served base model, the engine's adapter slots and the
    modules it applies LoRA to, where its disk cache (and, with registry.store unset, its store)
    lives, and its metrics."""

    model_dir: Path
    base_model_name: str
    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int
    cache_root: Path
    lora_targets: NotRequired[LoraTargets | None]  # vLLM's lora_target_modules; default: None
    metrics_registry: NotRequired[CollectorRegistry]  # default: prometheus_client's REGISTRY


async def build_registry(
    settings: RegistrySettings, engine: EngineLoraControl, **shape: Unpack[RegistryShape]
) -> ManagedRegistry:
    """The registry with its catalog read, not yet seeded or polling (tests and benchmarks)."""
    metrics = RegistryMetrics(shape.get("metrics_registry", REGISTRY))
    spec = await asyncio.to_thread(
        load_base_model_spec, shape["model_dir"], shape["base_model_name"]
    )
    cache_root = shape["cache_root"]
    store = open_store(settings.store or str(cache_root / "store"), settings)
    capacity = int(settings.disk_cache_gib * 1024**3)
    cache = await asyncio.to_thread(DiskCache, cache_root / "disk", capacity, metrics)
    pins = PinLimit.for_max_loras(shape["max_loras"])
    tiers = EngineTiers(engine, max_cpu=shape["max_cpu_loras"], pins=pins, metrics=metrics)
    catalog = Catalog(store)
    quarantines = Quarantines(catalog, metrics)
    residency = Residency(tiers, cache, store, quarantines, metrics, shape.get("lora_targets"))
    source = AdapterRegistry(settings, CatalogSync(catalog, metrics), residency, quarantines)
    registrar = Registrar(
        settings, spec, shape["max_lora_rank"], store, cache, metrics,
        shape.get("lora_targets"),
    )  # fmt: skip
    registry = ManagedRegistry(source, registrar, pins, metrics)
    try:
        await registry.refresh()
    except BaseException:
        cache.close()  # the next start (a retry, a test) may take the folder
        raise
    return registry


async def seed(registry: ManagedRegistry, folder: Path, *, examples: bool = False) -> None:
    """Register every adapter subfolder of `folder` under its folder name (unchanged: no-op).
    Raises AdapterInvalid, but with `examples` (the demo's adapters) one the engine's
    lora_target_modules leave out (`untargeted_module`) is logged and left out: the demo's MLP
    adapter on an engine restricted to attention must not stop the start."""
    subfolders = await asyncio.to_thread(
        lambda: sorted(p for p in folder.iterdir() if (p / CONFIG_FILE).is_file())
    )
    for sub in subfolders:
        try:
            check_new_name(sub.name, registry.registrar.spec.name)
        except AdapterError as e:  # a folder a name cannot take must not stop the start
            log.warning("adapter folder %s not registered: %s", sub, e.message)
            continue
        try:
            info = await registry.register(sub.name, str(sub))
        except AdapterInvalid as e:
            if not (examples and e.reason == "untargeted_module"):
                raise
            log.warning("demo adapter %s not registered: %s", sub.name, e.message)
            continue
        log.info("adapter %s registered from %s (version %s)", sub.name, sub, info.version[:12])


@contextlib.asynccontextmanager
async def open_adapter_source(
    settings: RegistrySettings,
    engine: EngineLoraControl,
    *,
    seed_dir: Path | None = None,
    **shape: Unpack[RegistryShape],
) -> AsyncIterator[ManagedRegistry]:
    """The server's registry for the life of the block (see the module docstring)."""
    registry = await build_registry(settings, engine, **shape)
    try:
        await sweep_leftovers(registry.sync, registry.cache, settings.orphan_grace_s)
        if settings.local_dir is not None:
            await seed(registry, settings.local_dir)
        elif seed_dir is not None:
            await seed(registry, seed_dir, examples=True)
        poller = asyncio.create_task(registry.poll_forever(), name="registry-poll")
        try:
            yield registry
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
    finally:
        registry.stop_background()
        registry.cache.close()
