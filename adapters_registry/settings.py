"""Configuration of the adapter registry (a section of loraplex's settings; read nowhere else)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class RegistrySettings(BaseModel):
    local_dir: Path | None = Field(
        None,
        description=(
            "Folder of adapters, one subfolder per adapter holding adapter_config.json and "
            "adapter_model.safetensors; unset with the embedded model serves its demo adapters."
        ),
    )
