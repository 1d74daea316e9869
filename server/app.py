"""The app factory: routes, error envelope, and the engine built in the lifespan (never at import,
because vLLM starts its engine core with `spawn`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import make_asgi_app

from loraplex.adapters_registry.lifecycle import open_adapter_source
from loraplex.server.engine.client import EngineClient
from loraplex.server.errors import install_error_handlers
from loraplex.server.generation import Gateway, InFlightLimit
from loraplex.server.model_choice import choose_served_model
from loraplex.server.routes import admin_adapters, health, openai
from loraplex.server.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served = choose_served_model(settings)
        engine = await EngineClient.start(settings.engine, served.model_dir, served.name)
        try:
            async with open_adapter_source(
                settings.registry,
                engine,
                model_dir=served.model_dir,
                base_model_name=served.name,
                max_lora_rank=settings.engine.max_lora_rank,
                max_loras=settings.engine.max_loras,
                max_cpu_loras=settings.engine.max_cpu_loras,
                cache_root=settings.cache_dir / "adapters",
                seed_dir=served.adapters_dir,
            ) as adapters:
                log.info(
                    "serving %s from %s with adapters %s",
                    served.name, served.model_dir, adapters.names(),
                )  # fmt: skip
                app.state.adapter_registry = adapters
                app.state.gateway = Gateway(
                    engine=engine,
                    adapters=adapters,
                    base_model=served.name,
                    in_flight=InFlightLimit(settings.engine.max_pending_requests),
                )
                yield
        finally:
            app.state.gateway = None
            app.state.adapter_registry = None
            engine.shutdown()

    app = FastAPI(title="loraplex", lifespan=lifespan)
    app.state.settings = settings
    app.state.gateway = None
    app.state.adapter_registry = None
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(health.router)
    app.include_router(admin_adapters.router)
    # vLLM registers its engine metrics in prometheus_client's default registry: serve them here.
    app.mount("/metrics", make_asgi_app())
    return app
