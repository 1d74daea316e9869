"""Which base model and adapter folder to serve: the embedded demo, or what settings name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters_registry.base_model import weight_files
from loraplex.server.settings import ConfigError, Settings


@dataclass(frozen=True)
class ServedModel:
    model_dir: Path
    name: str
    adapters_dir: Path | None


def choose_served_model(settings: Settings) -> ServedModel:
    """With no model configured, the embedded SmolLM2 and its demo adapters (built on first use)."""
    engine = settings.engine
    if engine.model is None:
        from loraplex.server.demo.adapters import ensure_demo_adapters
        from loraplex.server.demo.model import DEMO_MODEL_NAME, ensure_demo_model

        model_dir = ensure_demo_model(settings.cache_dir)
        adapters_dir = settings.registry.local_dir or ensure_demo_adapters(
            model_dir, settings.cache_dir
        )
        return ServedModel(model_dir, engine.served_model_name or DEMO_MODEL_NAME, adapters_dir)
    if not (engine.model / "config.json").is_file():
        raise ConfigError(
            f"engine.model: {engine.model} is not a Hugging Face model directory (no config.json)"
        )
    try:  # checked before the engine starts, which takes minutes on a GPU
        weight_files(engine.model)
    except FileNotFoundError as e:
        raise ConfigError(f"engine.model: {e}") from None
    name = engine.served_model_name or engine.model.resolve().name
    return ServedModel(engine.model, name, settings.registry.local_dir)
