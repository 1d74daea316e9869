"""Adapters from the Hugging Face Hub (`hf://org/name[@revision][/folder]`): through a local Hub
cache laid out as huggingface_hub writes it, offline (HF_HUB_OFFLINE, as in CI: no network here),
with the checks of any other source (content-addressed versions, the disk cache, link rules, size
caps); and, against a stand-in for the Hub's HTTP API on loopback, what happens while it answers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest
from fake_hub import FakeHub
from registry_builders import adapter_config, dense_tensors, write_adapter
from registry_rig import Rig

from loraplex.adapters_registry.base import AdapterInvalid, ErrorKind
from loraplex.adapters_registry.disk_cache import digest_folder
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.sources import fetch_source
from loraplex.adapters_registry.validation import ADAPTER_FILES, WEIGHTS_FILE
from tests.support.hub_cache import cache_repo

REPO = "acme/loras"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hugging Face cache holding acme/loras at main: an adapter at its root and
    one in its folder `mlp/`."""
    src = tmp_path / "repo"
    write_adapter(src, adapter_config(), dense_tensors(seed=1))
    write_adapter(src / "mlp", adapter_config(), dense_tensors(seed=2))
    cache = tmp_path / "hf" / "hub"
    cache_repo(cache, REPO, src)
    # huggingface_hub reads both when imported, and this process imported it long ago.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.anyio
async def test_an_hf_adapter_registers_from_the_cache_and_serves(
    rig: Rig, hub_cache: Path, tmp_path: Path
) -> None:
    a, b = await rig.registry("a"), await rig.registry("b")
    info = await a.register("acme/mlp", f"hf://{REPO}@main/mlp")
    # The same version as the same bytes from anywhere else: sha256 over the files.
    assert info.version == digest_folder(tmp_path / "repo" / "mlp", ADAPTER_FILES)[0]
    assert info.source == f"hf://{REPO}@main/mlp" and info.tier == "disk"
    root = await a.register("acme/root", f"hf://{REPO}")
    assert root.version == digest_folder(tmp_path / "repo", ADAPTER_FILES)[0]
    await b.refresh()  # another replica fetches it from the registry's store, not the Hub
    async with b.lease("acme/mlp") as adapter:
        assert adapter.version == info.version
        served = adapter.path / WEIGHTS_FILE
        assert served.read_bytes() == (tmp_path / "repo" / "mlp" / WEIGHTS_FILE).read_bytes()
        assert not served.is_symlink()  # a copy in the disk cache, not a link into the Hub's


@pytest.mark.parametrize(
    ("source", "said"),
    [
        (f"hf://{REPO}@v9/mlp", "revision 'v9' of acme/loras is not in the Hugging Face cache"),
        ("hf://acme/other", "acme/other is not in the Hugging Face cache"),
        (f"hf://{REPO}/attn", "has no folder 'attn'"),
        (f"hf://{REPO}/../mlp", "may not hold '.', '..'"),
        (f"hf://{REPO}@../../refs/main", "may not hold '.', '..'"),
        (f"hf://datasets/{REPO}", "names a dataset repository"),
        ("hf://acme", "Repository id must be 'namespace/name'"),
    ],
    ids=[
        "revision",
        "repo",
        "folder",
        "climbing-folder",
        "climbing-revision",
        "dataset",
        "no-name",
    ],
)
@pytest.mark.anyio
async def test_an_hf_source_that_cannot_be_resolved_is_a_400_naming_it(
    rig: Rig, hub_cache: Path, source: str, said: str
) -> None:
    reg = await rig.registry("a")
    with pytest.raises(AdapterInvalid) as err:
        await reg.register("acme/bot", source)
    assert err.value.kind is ErrorKind.INVALID and err.value.param == "source"
    assert source in err.value.message and said in err.value.message, err.value.message
    assert reg.names() == []


def test_a_cache_blob_linked_out_of_its_filesystem_is_refused(
    hub_cache: Path, tmp_path: Path
) -> None:
    """The link rules of local sources hold in the cache: its files are links to its blobs."""
    link = hub_cache / "models--acme--loras" / "snapshots"
    (snapshot,) = link.iterdir()
    blob = (snapshot / "mlp" / WEIGHTS_FILE).resolve()
    blob.unlink()
    blob.symlink_to("/proc/self/pagemap")  # lists as 0 bytes, reads without end
    (tmp_path / "dest").mkdir()
    with pytest.raises(AdapterInvalid, match="another filesystem"):
        fetch_source(f"hf://{REPO}/mlp", tmp_path / "dest", RegistrySettings())
    assert not (tmp_path / "dest" / WEIGHTS_FILE).exists()


@pytest.fixture
def online_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """acme/online on a stand-in Hub: `small/` a 1 MiB-cap adapter, `big/` one of 2 MiB."""
    src = tmp_path / "online"
    write_adapter(src / "small")
    big = write_adapter(src / "big")
    with (big / WEIGHTS_FILE).open("ab") as f:
        f.truncate(2 << 20)
    hub = FakeHub({"acme/online": src})
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        huggingface_hub.constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield hub
    hub.close()


def test_while_the_hub_answers_an_oversized_adapter_is_refused_before_it_downloads(
    online_hub: FakeHub, tmp_path: Path
) -> None:
    (tmp_path / "dest").mkdir()
    settings = RegistrySettings(max_adapter_mib=1, disk_cache_gib=1)
    with pytest.raises(AdapterInvalid) as err:
        fetch_source("hf://acme/online/big", tmp_path / "dest", settings)
    assert err.value.reason == "size" and "registry.max_adapter_mib allows at most 1048576" in (
        err.value.message
    )
    assert online_hub.downloads == []  # not a byte of either file


def test_while_the_hub_answers_an_adapter_is_fetched_into_its_cache(
    online_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = RegistrySettings(max_adapter_mib=1, disk_cache_gib=1)
    (tmp_path / "dest").mkdir()
    fetch_source("hf://acme/online/small", tmp_path / "dest", settings)
    assert sorted(online_hub.downloads) == [f"acme/online/small/{f}" for f in sorted(ADAPTER_FILES)]
    for name in ADAPTER_FILES:
        assert (tmp_path / "dest" / name).read_bytes() == (
            tmp_path / "online" / "small" / name
        ).read_bytes()
    # Cached as huggingface_hub caches it: the next fetch needs no Hub.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "again").mkdir()
    fetch_source("hf://acme/online@main/small", tmp_path / "again", settings)
    assert os.listdir(tmp_path / "again") == os.listdir(tmp_path / "dest")
