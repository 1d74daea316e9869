"""Which model `serve` takes: a model directory is checked before the engine starts, a Hub id is
resolved through an offline Hugging Face cache laid out as huggingface_hub writes it (pure logic
over temporary folders; serving the embedded demo and a Hub id is covered by live-server tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.server.model_choice import ServedModel, choose_served_model
from loraplex.server.settings import ConfigError, load_settings
from tests.support.hub_cache import cache_repo


def _choose(model: Path | str, monkeypatch: pytest.MonkeyPatch) -> ServedModel:
    monkeypatch.setenv("LORAPLEX_ENGINE__MODEL", str(model))
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


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """An offline Hugging Face cache (HF_HUB_CACHE) holding org/model at branch main."""
    import huggingface_hub.constants

    model = tmp_path / "src"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    cache = tmp_path / "hf" / "hub"
    commit = cache_repo(cache, "org/model", model)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads both when imported, and this process imported it long ago.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache, commit


@pytest.mark.parametrize("revision", ["", "@main", "@commit"])
def test_a_hub_id_is_served_from_the_hugging_face_cache_offline(
    hub: tuple[Path, str], monkeypatch: pytest.MonkeyPatch, revision: str
) -> None:
    cache, commit = hub
    revision = revision.replace("commit", commit)
    served = _choose("org/model" + revision, monkeypatch)
    assert served.model_dir == cache / "models--org--model" / "snapshots" / commit
    assert (served.model_dir / "model.safetensors").read_bytes() == b"weights"
    assert served.name == "org/model"  # as vLLM serves a Hub model


@pytest.mark.parametrize(
    ("model", "said"),
    [("org/model@v2", "engine.model: org/model@v2: revision 'v2' of org/model is not in the "
      "Hugging Face cache ({cache}), which holds main, {commit}, and HF_HUB_OFFLINE is set"),
     ("org/other", "engine.model: org/other: org/other is not in the Hugging Face cache ({cache}), "
      "and HF_HUB_OFFLINE is set"),
     ("org/model@", "engine.model: 'org/model@' is neither a directory nor a Hugging Face Hub id"),
     ("./missing", "engine.model: no such directory: ./missing")],
    ids=["missing-revision", "missing-repo", "empty-revision", "missing-folder"],
)  # fmt: skip
def test_a_hub_id_that_cannot_be_resolved_is_a_clear_error(
    hub: tuple[Path, str], monkeypatch: pytest.MonkeyPatch, model: str, said: str
) -> None:
    cache, commit = hub
    with pytest.raises(ConfigError) as e:
        _choose(model, monkeypatch)
    assert said.format(cache=cache, commit=commit) in str(e.value)


def test_vllms_download_dir_names_the_cache(
    hub: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    cache, commit = hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache.parent / "elsewhere"))
    monkeypatch.setenv("LORAPLEX_ENGINE__VLLM_ARGS", json.dumps({"download_dir": str(cache)}))
    assert _choose("org/model", monkeypatch).model_dir.name == commit
