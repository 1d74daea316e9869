"""Which model `serve` takes: a model directory is checked before the engine starts (pure logic
over temporary folders; serving the embedded demo is covered by the live-server tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.server.model_choice import ServedModel, choose_served_model
from loraplex.server.settings import ConfigError, load_settings


def _choose(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> ServedModel:
    monkeypatch.setenv("LORAPLEX_ENGINE__MODEL", str(model_dir))
    return choose_served_model(load_settings())


def test_a_folder_without_config_json_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"engine\.model: .* \(no config\.json\)"):
        _choose(tmp_path, monkeypatch)


def test_a_model_without_safetensors_weights_is_refused_before_the_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(ConfigError, match=r"engine\.model: .* no \*\.safetensors weights"):
        _choose(tmp_path, monkeypatch)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_model_with_safetensors_weights_is_served_under_its_folders_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    if layout == "single":
        (model / "model.safetensors").write_bytes(b"")
    else:
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
    served = _choose(model, monkeypatch)
    assert served.model_dir == model and served.name == "my-model"
