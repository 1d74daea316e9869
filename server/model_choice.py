"""Which base model and adapter folder to serve: the embedded demo, a model directory, or a model
on the Hugging Face Hub (`org/name[@revision]`), resolved to a local snapshot as vLLM would.

loraplex needs the model's files on local disk before the engine starts (adapters are validated
against its safetensors headers), so a Hub id is resolved here with huggingface_hub, which
honours its cache (HF_HOME, HF_HUB_CACHE), token (HF_TOKEN or `hf auth login`) and offline mode
(HF_HUB_OFFLINE) as vLLM's own download does (`adapters_registry.hub`, which adapter sources
on the Hub share); the engine then loads the local snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters_registry.base_model import weight_files
from loraplex.adapters_registry.hub import HubError, HubRef, hub_snapshot
from loraplex.server.settings import ConfigError, Settings

# What a served model needs from its repository: config, tokenizer and chat template, generation
# config, safetensors weights (and code for trust_remote_code models); not other weight formats.
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py")


@dataclass(frozen=True)
class ServedModel:
    model_dir: Path
    name: str
    adapters_dir: Path | None


def _model_dir(model: str, vllm_args: dict[str, Any]) -> tuple[Path, str]:
    """(local model directory, the name vLLM would serve it under) for engine.model."""
    path = Path(model).expanduser()
    if path.exists():
        return path, path.resolve().name
    if model.startswith(("/", ".", "~")):
        raise ConfigError(f"engine.model: no such directory: {model}")
    ref = HubRef.parse(model)
    if ref is None:
        raise ConfigError(
            f"engine.model: {model!r} is neither a directory nor a Hugging Face Hub id "
            "(org/name or org/name@revision)"
        )
    download_dir, token = vllm_args.get("download_dir"), vllm_args.get("hf_token")
    try:
        folder = hub_snapshot(
            ref,
            MODEL_FILES,
            cache_dir=Path(download_dir) if download_dir else None,
            token=token if isinstance(token, str) else None,
        )
    except HubError as e:
        raise ConfigError(f"engine.model: {e}") from None
    return folder, ref.repo_id


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
    model_dir, name = _model_dir(engine.model, engine.vllm_args)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"engine.model: {model_dir} is not a Hugging Face model directory (no config.json)"
        )
    try:  # checked before the engine starts, which takes minutes on a GPU
        weight_files(model_dir)
    except FileNotFoundError as e:
        raise ConfigError(f"engine.model: {e}") from None
    return ServedModel(model_dir, engine.served_model_name or name, settings.registry.local_dir)
