"""uvicorn, configured for the gateway: the API's listener, the /metrics listener when
`http.metrics_port` is set (metrics_access says why), the connection bounds of `connections`
on both, and the drain on SIGTERM (drain.py): the first SIGTERM or SIGINT drains, then uvicorn
shuts down as usual (listeners closed, the lifespan stops the engine); a second one cuts what
still runs and shuts down at once.

Both listeners open once the app's lifespan has started the engine, as the API's always did.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from types import FrameType

import uvicorn
from fastapi import FastAPI

from loraplex.server.connections import guarded_protocol
from loraplex.server.drain import Drain
from loraplex.server.settings import HttpSettings

log = logging.getLogger(__name__)

# uvicorn's exit status for a server that could not start.
STARTUP_FAILURE = 3
# After the drain, how long uvicorn waits for connections to close before cancelling them: the
# drain has ended or cut every request by then, so this only covers their last writes.
GRACEFUL_SHUTDOWN_S = 5


class _GatewayServer(uvicorn.Server):
    """A uvicorn server that drains at the first signal, and also listens on
    http.metrics_host:metrics_port, through the same protocol and app (the app tells the
    listeners apart by the port a request came in on)."""

    def __init__(self, config: uvicorn.Config, http: HttpSettings, drain: Drain) -> None:
        super().__init__(config)
        self._http = http
        self._drain = drain
        self._drain_task: asyncio.Task[None] | None = None  # held: the loop keeps weak refs
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first signal drains, then exits; a later one (or one before the listeners
        opened) is uvicorn's own: exit now, cutting whatever still runs."""
        loop = self._loop
        if loop is None or self.should_exit or self._drain.draining:
            if loop is not None:
                loop.call_soon_threadsafe(self._drain.cut)
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised after the shutdown, as uvicorn does
        self._drain.begin()  # /ready and new requests answer 503 from here on
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        log.info(
            "draining: requests in flight have %s s (http.drain_s) to finish", self._drain.drain_s
        )

        async def drain_then_exit() -> None:
            try:
                await self._drain.run()
            finally:
                self.should_exit = True

        self._drain_task = asyncio.get_running_loop().create_task(drain_then_exit())

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        if not self.started or self._http.metrics_port is None:
            return
        config = self.config

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        host, port = self._http.metrics_host, self._http.metrics_port
        try:
            server = await asyncio.get_running_loop().create_server(protocol, host, port)
        except OSError as e:
            log.error("cannot open the /metrics listener on %s:%d: %s", host, port, e)
            await self.shutdown()
            sys.exit(STARTUP_FAILURE)
        self.servers.append(server)
        log.info("/metrics on http://%s:%d", host, port)


def run(app: FastAPI, http: HttpSettings) -> None:
    config = uvicorn.Config(
        app,
        host=http.host,
        port=http.port,
        log_level=http.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=guarded_protocol(http),
    )
    _GatewayServer(config, http, app.state.drain).run()
