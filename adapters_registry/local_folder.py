"""Adapters from a local folder: one subfolder per adapter, read once at start.

The simplest `AdapterSource`: what the embedded default serves. Each subfolder holding
`adapter_config.json` and `adapter_model.safetensors` is an adapter named after the subfolder.
The version is the sha256 of those two files, and engine ids are handed out in sorted-name order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from loraplex.adapters_registry.base import AdapterError, AdapterNotFound, ServableAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def content_version(folder: Path) -> str:
    """sha256 over the adapter's config and weights, in a fixed order: its immutable version."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with (folder / name).open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


class LocalFolderSource:
    """Serves the adapters found under `root` when constructed (none if `root` is None)."""

    def __init__(self, root: Path | None) -> None:
        self._adapters: dict[str, ServableAdapter] = {}
        if root is None:
            return
        if not root.is_dir():
            raise AdapterError(f"adapter folder {root} does not exist", param="registry.local_dir")
        folders = sorted(p for p in root.iterdir() if (p / CONFIG_FILE).is_file())
        for engine_id, folder in enumerate(folders, start=1):
            if not (folder / WEIGHTS_FILE).is_file():
                raise AdapterError(f"adapter {folder.name}: {WEIGHTS_FILE} is missing")
            config = json.loads((folder / CONFIG_FILE).read_text())
            self._adapters[folder.name] = ServableAdapter(
                name=folder.name,
                version=content_version(folder),
                engine_id=engine_id,
                path=folder.resolve(),
                rank=int(config["r"]),
            )

    @asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[ServableAdapter]:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise AdapterNotFound(f"The model `{name}` does not exist.", param="model")
        yield adapter

    def names(self) -> list[str]:
        return sorted(self._adapters)
