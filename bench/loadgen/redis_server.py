"""A real Redis server (Debian's `redis-server`) on loopback for the quota-store tests and bench.

No persistence (no RDB snapshots, no AOF), so `restart` comes back empty, as a Redis without
persistence does after a crash; the port stays the same, so clients reconnect by themselves.
`stop` (SIGTERM) and `kill` make it refuse connections; `pause` (SIGSTOP) leaves the socket open
and unanswered, as a hung server or a dropped network does.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from bench.loadgen.polling import wait_until
from bench.loadgen.server import free_port


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    assert found, (
        "redis-server not found: the quota-store tests run Debian's `redis-server` package "
        "(scripts/setup.sh dev installs it; or apt-get install redis-server)"
    )
    return found


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.binary = redis_server_binary()
        self.port = free_port()
        self.workdir = workdir
        self.log_path = workdir / f"redis-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", str(self.workdir),
                    "--daemonize", "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        if not wait_until(self._answers, 20, 0.05):
            self.kill()
            raise RuntimeError(f"redis-server did not start:\n{self.log_path.read_text()[-2000:]}")
        return self

    def _answers(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited:\n{self.log_path.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Shut it down (SIGTERM): connections are refused from now on."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            self.proc.wait(10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> RedisServer:
        """Stop it and start it again on the same port, empty."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the port accepts connections (the kernel's backlog) but nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
