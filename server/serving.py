"""uvicorn, configured for the gateway: the API's listener, the /metrics listener when
`http.metrics_port` is set (metrics_access says why), and the connection bounds of `connections`
on both.

Both listeners open once the app's lifespan has started the engine, as the API's always did.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

import uvicorn
from fastapi import FastAPI

from loraplex.server.connections import guarded_protocol
from loraplex.server.settings import HttpSettings

log = logging.getLogger(__name__)

# uvicorn's exit status for a server that could not start.
STARTUP_FAILURE = 3


class _WithMetricsListener(uvicorn.Server):
    """A uvicorn server that also listens on http.metrics_host:metrics_port, through the same
    protocol and app (the app tells the listeners apart by the port a request came in on)."""

    def __init__(self, config: uvicorn.Config, http: HttpSettings) -> None:
        super().__init__(config)
        self._http = http

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
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
        timeout_graceful_shutdown=5,
        http=guarded_protocol(http),
    )
    _WithMetricsListener(config, http).run()
