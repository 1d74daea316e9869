"""The drop-in tests' server (tests/server/test_dropin_*.py): the embedded model served by its
Hub id from an offline Hugging Face cache, with a generation_config.json of non-default sampling,
two tenants and an adapter of one of them.

The model's own chat template has no tools; the server takes a ChatML template that renders
them as the Hermes format (`<tool_call>` JSON in the assistant's turn, `<tool_response>` for a
tool's answer: tests/support/chat_templates/smollm2_tools.jinja, identical to the model's own
for conversations without tools), with vLLM's `hermes` tool parser. Constrained JSON is written
without free whitespace (xgrammar's `disable_any_whitespace`), which a 135M model would
otherwise fill its token budget with.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.loadgen.server import ServerProcess
from loraplex.server.demo.adapters import ensure_demo_adapters
from loraplex.server.demo.model import ensure_demo_model
from loraplex.server.settings import default_cache_dir
from tests.support.hub_cache import cache_repo

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TEMPLATE = Path(__file__).parent / "chat_templates" / "smollm2_tools.jinja"
# Non-default sampling in the model's generation_config.json: vLLM applies it to requests that
# leave these fields unset.
GENERATION = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
ADMIN_TOKEN = "admin-token-for-dropin-tests"
ACME_KEY = "acme-key-for-dropin-tests-0123"
GLOBEX_KEY = "globex-key-for-dropin-tests-0123"
GLOBEX_ADAPTER = "globex/bot"
ENGINE = {
    "model": HUB_ID,
    "dtype": "float32",
    "tool_call_parser": "hermes",
    "enable_auto_tool_choice": True,
    "vllm_args": {
        "chat_template": str(TEMPLATE),
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    },
}


def hub_snapshot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(Hugging Face cache, the model's snapshot in it): the embedded model with GENERATION."""
    source = tmp_path_factory.mktemp("model")
    demo = ensure_demo_model(default_cache_dir())
    for file in demo.iterdir():
        if file.is_file() and not file.name.startswith("."):
            shutil.copy(file, source / file.name)
    config = json.loads((demo / "generation_config.json").read_text())
    (source / "generation_config.json").write_text(json.dumps({**config, **GENERATION}))
    cache = tmp_path_factory.mktemp("hf") / "hub"
    commit = cache_repo(cache, HUB_ID, source)
    return cache, cache / ("models--" + HUB_ID.replace("/", "--")) / "snapshots" / commit


@contextlib.contextmanager
def dropin_server(snapshot: tuple[Path, Path], work: Path) -> Iterator[ServerProcess]:
    """loraplex serving `snapshot` with ENGINE, tenants acme and globex, and globex's adapter
    GLOBEX_ADAPTER registered; stopped on exit."""
    cache, model_dir = snapshot
    config = {
        "cache_dir": str(work / "cache"),
        "engine": ENGINE,
        "http": {"admin_token": ADMIN_TOKEN},
        "registry": {"local_dir": str(ensure_demo_adapters(model_dir, default_cache_dir()))},
        "tenancy": {
            "tenants": [
                {"id": "acme", "api_keys": [ACME_KEY]},
                {"id": "globex", "api_keys": [GLOBEX_KEY]},
            ]
        },
    }
    (work / "loraplex.yaml").write_text(yaml.safe_dump(config))
    env = {
        "LORAPLEX_CONFIG_FILE": str(work / "loraplex.yaml"),
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
    }
    process = ServerProcess(env=env).start()
    try:
        registered = httpx.post(
            process.base_url + "/admin/v1/adapters",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            json={
                "name": GLOBEX_ADAPTER,
                "source": str(default_cache_dir() / "demo-adapters" / "demo-attn"),
            },
            timeout=60,
        )
        assert registered.status_code == 201, registered.text
        yield process
    finally:
        process.stop()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]
