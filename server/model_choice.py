"""Which base model and adapter folder to serve: the embedded demo, a model directory, or a model
on the Hugging Face Hub (`org/name[@revision]`), resolved to a local snapshot as vLLM would.

loraplex needs the model's files on local disk before the engine starts (adapters are validated
against its safetensors headers), so a Hub id is resolved here with huggingface_hub, which
honours its cache (HF_HOME, HF_HUB_CACHE), token (HF_TOKEN or `hf auth login`) and offline mode
(HF_HUB_OFFLINE) as vLLM's own download does; the engine then loads the local snapshot.
`hub_snapshot` depends on nothing else in loraplex, so other Hub sources can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters_registry.base_model import weight_files
from loraplex.server.settings import ConfigError, Settings

# What a served model needs from its repository: config, tokenizer and chat template, generation
# config, safetensors weights (and code for trust_remote_code models); not other weight formats.
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py")


@dataclass(frozen=True)
class ServedModel:
    model_dir: Path
    name: str
    adapters_dir: Path | None


@dataclass(frozen=True)
class HubRef:
    """`org/name` or `org/name@revision` (a branch, tag or commit)."""

    repo_id: str
    revision: str | None = None

    @classmethod
    def parse(cls, text: str) -> HubRef | None:
        """The reference `text` spells, or None if it is not a valid Hub repository id."""
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        repo_id, at, revision = text.strip().partition("@")
        if at and not revision:
            return None
        try:
            validate_repo_id(repo_id)
        except HFValidationError:
            return None
        return cls(repo_id, revision or None)

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


class HubError(LookupError):
    """A Hub reference that cannot be resolved; the message says why, naming the reference."""


def _cached_revisions(cache_dir: Path, repo_id: str) -> list[str] | None:
    """Branch or tag names and commits of `repo_id` in the cache; None if it has none of it."""
    folder = cache_dir / ("models--" + repo_id.replace("/", "--"))
    if not folder.is_dir():
        return None
    found: list[str] = []
    for kind in ("refs", "snapshots"):
        if (folder / kind).is_dir():
            found += sorted(p.name for p in (folder / kind).iterdir())
    return found


def hub_snapshot(
    ref: HubRef,
    allow_patterns: tuple[str, ...],
    *,
    cache_dir: Path | None = None,
    token: str | None = None,
) -> Path:
    """The local snapshot folder of `ref`, downloaded into the Hugging Face cache if it is not
    there (only files matching `allow_patterns`, top-level files only). Raises HubError."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    try:
        folder = snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            cache_dir=cache,
            token=token,
            allow_patterns=list(allow_patterns),
            ignore_patterns=["*/*"],
        )
    except RevisionNotFoundError:
        raise HubError(f"{ref}: the repository has no revision {ref.revision!r}") from None
    except GatedRepoError:
        raise HubError(f"{ref}: a gated repository this token may not read") from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{ref}: no such repository on the Hub (or a private one this token may not read)"
        ) from None
    except LocalEntryNotFoundError:
        revisions = _cached_revisions(cache, ref.repo_id)
        where = f"the Hugging Face cache ({cache})"
        if revisions is None:
            cached = f"{ref.repo_id} is not in {where}"
        else:
            cached = (
                f"revision {ref.revision or 'main'!r} of {ref.repo_id} is not in {where}, "
                f"which holds {', '.join(revisions) or 'none'}"
            )
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub is unreachable"
        raise HubError(f"{ref}: {cached}, and {offline}") from None
    return Path(str(folder))


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
