"""`--model DIR` serves any Hugging Face directory; when the engine dies, the server says so:
/health and /ready turn 503 and requests get a 503 in OpenAI's envelope instead of hanging. When
the server dies, even by SIGKILL, the processes it started die with it (issue 45, finding 7)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from bench.loadgen.polling import wait_until
from bench.loadgen.server import REPO, ServerProcess

# What "within a few seconds" allows: the kernel signals a child as its parent exits; the rest
# is a loaded 2-core CI machine getting round to reaping it.
DIES_WITHIN_S = 10.0


def _model_dir_env(cache: Path) -> dict[str, str]:
    # Its own cache dir: the adapter catalog there is empty, so only the base model is listed.
    return {"LORAPLEX_ENGINE__SERVED_MODEL_NAME": "smol", "LORAPLEX_CACHE_DIR": str(cache)}


@pytest.fixture(scope="module")
def model_dir_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    model_dir = ensure_demo_model(default_cache_dir())
    server = ServerProcess(
        env=_model_dir_env(tmp_path_factory.mktemp("cache")), args=["--model", str(model_dir)]
    ).start()
    yield server
    server.stop()


def test_model_dir_is_served_under_its_configured_name(model_dir_server: ServerProcess) -> None:
    url = model_dir_server.base_url
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["smol"]
    reply = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": "smol", "prompt": "Hello", "max_tokens": 4},
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_engine_death_is_reported_unhealthy(model_dir_server: ServerProcess) -> None:
    url = model_dir_server.base_url
    assert model_dir_server.proc is not None
    cores = [
        p
        for p in psutil.Process(model_dir_server.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()
    ]
    assert cores, "no vLLM engine-core process found under the server"
    for core in cores:
        core.kill()
    wait_until(lambda: httpx.get(url + "/health").status_code == 503, 30)
    assert httpx.get(url + "/health").status_code == 503
    assert httpx.get(url + "/ready").status_code == 503
    reply = httpx.post(
        url + "/v1/completions",
        timeout=30,
        json={"model": "smol", "prompt": "Hello", "max_tokens": 4},
    )
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "engine_unavailable"


def test_engine_processes_die_with_a_killed_server(tmp_path: Path) -> None:
    """After kill -9 of the server, vLLM's engine core and worker went on running (130% CPU,
    4.8 GB). Only the server is killed here, not its process group (which would kill its
    children directly): the engine core, its worker and the gateway's body-parsing workers
    must go by themselves."""
    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    model_dir = ensure_demo_model(default_cache_dir())
    server = ServerProcess(env=_model_dir_env(tmp_path), args=["--model", str(model_dir)]).start()
    try:
        assert server.proc is not None
        children = psutil.Process(server.proc.pid).children(recursive=True)
        names = [" ".join(c.cmdline()) or c.name() for c in children]
        assert any("EngineCore" in n for n in names), names
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        _, alive = psutil.wait_procs(children, timeout=DIES_WITHIN_S)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        server.kill9()  # whatever is left of its process group


_PARENT = textwrap.dedent("""
    import multiprocessing, sys, time
    from loraplex.server.engine import parent_death

    def child(register: bool) -> None:
        if register:
            parent_death.register()  # what vLLM calls in each process it starts
        time.sleep(600)

    if __name__ == "__main__":
        process = multiprocessing.get_context("spawn").Process(
            target=child, args=(sys.argv[1] == "register",))
        process.start()
        print(process.pid, flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("register", [True, False])
def test_a_spawned_process_that_registers_dies_with_its_parent(
    tmp_path: Path, register: bool
) -> None:
    """The plugin alone, without vLLM: a child started as vLLM starts its engine core (spawn)
    dies when its parent is killed if it registered, and outlives it if not."""
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), "register" if register else "no"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        # Sleeping: it registered, or is still importing (then it finds its parent gone when
        # it registers, and dies then).
        wait_until(lambda: child.status() == psutil.STATUS_SLEEPING, 30, 0.1)
        parent.kill()
        parent.wait()
        _, alive = psutil.wait_procs([child], timeout=DIES_WITHIN_S)
        assert bool(alive) is not register
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing of the group left
            os.killpg(parent.pid, signal.SIGKILL)
