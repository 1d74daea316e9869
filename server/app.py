"""The app factory: routes, error envelope, and the engine built in the lifespan (never at import,
because vLLM starts its engine core with `spawn`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import make_asgi_app

from loraplex.adapters_registry.local_folder import LocalFolderSource
from loraplex.server.engine.client import EngineClient
from loraplex.server.errors import install_error_handlers
from loraplex.server.generation import Gateway, InFlightLimit
from loraplex.server.model_choice import choose_served_model
from loraplex.server.routes import health, openai
from loraplex.server.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served = choose_served_model(settings)
        adapters = LocalFolderSource(served.adapters_dir)
        log.info(
            "serving %s from %s with adapters %s", served.name, served.model_dir, adapters.names()
        )
        engine = await EngineClient.start(settings.engine, served.model_dir, served.name)
        try:
            app.state.gateway = Gateway(
                engine=engine,
                adapters=adapters,
                base_model=served.name,
                in_flight=InFlightLimit(settings.engine.max_pending_requests),
            )
            yield
        finally:
            app.state.gateway = None
            engine.shutdown()

    app = FastAPI(title="loraplex", lifespan=lifespan)
    app.state.settings = settings
    app.state.gateway = None
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(health.router)
    # vLLM registers its engine metrics in prometheus_client's default registry: serve them here.
    app.mount("/metrics", make_asgi_app())
    return app
