"""Issue 45, finding 1 at registration: an adapter whose header is valid but whose values are NaN
(a diverged fine-tune) or merely huge (1e30) registered with 201 and then poisoned every
tenant's outputs. Now registration reads every value and refuses both with a 400 naming the
tensor, the value and where; nothing is registered, and the bystanders' outputs are unchanged.
(The engine guard for values within the bound is another case's.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.loadgen.server import LiveServer
from loraplex.server.settings import default_cache_dir
from tests.support.bystanders import Bystanders, admin

TENSOR = "base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight"


def poisoned_copy(folder: Path, value: float) -> Path:
    """demo-attn with `value` written into one element of TENSOR (fp32, as the demo's)."""
    shutil.copytree(default_cache_dir() / "demo-adapters" / "demo-attn", folder)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    assert tensors[TENSOR].dtype == torch.float32
    tensors[TENSOR][7, 2] = value
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(
    ("value", "reason", "says"),
    [
        (float("nan"), "non-finite", "holds nan at [7, 2]"),
        (1e30, "magnitude", "holds 1e+30 at [7, 2]"),
    ],
    ids=["nan", "1e30"],
)
def test_a_poisoned_adapter_is_refused_at_registration(
    shared_server: LiveServer, bystanders: Bystanders, tmp_path: Path, value: float, reason: str,
    says: str,
) -> None:  # fmt: skip
    name = f"mallory/poison-{reason}"
    source = poisoned_copy(tmp_path / "adapter", value)
    r = admin(
        shared_server, "POST", "/admin/v1/adapters", json={"name": name, "source": str(source)}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == TENSOR and says in error["message"], error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_adapter"
    assert admin(shared_server, "GET", f"/admin/v1/adapters/{name}").status_code == 404
    bystanders.assert_unchanged()
