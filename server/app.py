"""The app factory: routes, error envelope, and the engine built in the lifespan (never at import,
because vLLM starts its engine core with `spawn`)."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from prometheus_client import REGISTRY, CollectorRegistry

from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.lifecycle import open_adapter_source
from loraplex.server.access_log import AccessLogMiddleware, install_json_handler
from loraplex.server.body_limit import BodyLimitMiddleware
from loraplex.server.drain import Drain, DrainGate
from loraplex.server.engine.client import EngineClient
from loraplex.server.engine.lora_targets import lora_targets
from loraplex.server.errors import install_error_handlers
from loraplex.server.generation import Gateway
from loraplex.server.lora_activity import LoraActivity
from loraplex.server.metrics import METRICS_CONTENT_TYPE, GatewayMetrics
from loraplex.server.metrics_access import (
    METRICS_PATH,
    PICKER_METRICS_PATH,
    MetricsAccess,
    MetricsListenerOnly,
)
from loraplex.server.metrics_scrape import MetricsScrape
from loraplex.server.model_choice import choose_served_model
from loraplex.server.picker_metrics import EngineMetrics, PickerMetrics, picker_exposition
from loraplex.server.request_body import BodyParser
from loraplex.server.routes import admin_adapters, admin_tenants, fairness, health, openai
from loraplex.server.settings import Settings
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.service import Tenancy
from loraplex.server.tenancy.store import TenantStore
from loraplex.server.vllm_serving import EngineView, build_serving

log = logging.getLogger(__name__)


@asynccontextmanager
async def _tenancy(
    settings: Settings, adapters: ManagedRegistry, metrics: GatewayMetrics
) -> AsyncIterator[Tenancy]:
    # Tenants live in the adapter catalog's log, which the registry's poll follows.
    directory = TenantDirectory(
        settings.tenancy,
        TenantStore(adapters.sync, settings.tenancy.store_prefix),
        settings.http.admin_token,
    )
    await directory.start()
    tenancy = Tenancy(settings.tenancy, directory, metrics)
    async with tenancy.sharing_quotas():
        yield tenancy


def _freeze_startup_heap() -> None:
    """Move everything alive after start-up (vLLM, torch, transformers: millions of objects) out
    of the collector's reach, as vLLM's own API server does. A full collection scans every tracked
    object while holding the GIL, so it stops the event loop and every stream with it: gen-2
    collections took 26-350 ms in the gateway by the end of start-up (gc callbacks, 2-core CI
    machine); after the freeze none over 20 ms was seen through the cold-adapter ITL test."""
    gc.collect()
    gc.freeze()


@asynccontextmanager
async def _body_parser(settings: Settings) -> AsyncIterator[BodyParser]:
    """The processes that parse large bodies off the event loop (request_body.py); vLLM's
    renderer templates and tokenizes in its own threads."""
    parser = BodyParser(settings.http.body_parse_processes)
    try:
        await parser.start()
        yield parser
    finally:
        parser.close()


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served = choose_served_model(settings)
        engine = await EngineClient.start(settings.engine, served.model_dir, served.name)
        try:
            async with (
                open_adapter_source(
                    settings.registry,
                    engine,
                    model_dir=served.model_dir,
                    base_model_name=served.name,
                    max_lora_rank=settings.engine.max_lora_rank,
                    max_loras=settings.engine.max_loras,
                    max_cpu_loras=settings.engine.max_cpu_loras,
                    lora_targets=lora_targets(engine.vllm_config),
                    cache_root=settings.cache_dir / "adapters",
                    seed_dir=served.adapters_dir,
                ) as adapters,
                _tenancy(settings, adapters, metrics) as tenancy,
                _body_parser(settings) as body_parser,
            ):
                log.info(
                    "serving %s from %s with adapters %s",
                    served.name, served.model_dir, adapters.names(),
                )  # fmt: skip
                app.state.adapter_registry = adapters
                app.state.tenancy = tenancy
                app.state.body_parser = body_parser
                view = EngineView(engine, await engine.async_llm.get_supported_tasks())
                app.state.gateway = Gateway(
                    engine=engine,
                    adapters=adapters,
                    base_model=served.name,
                    tenancy=tenancy,
                    serving=build_serving(
                        view, engine.namespace, served.model_dir, served.name, adapters
                    ),
                    activity=activity,
                    drain=app.state.drain,
                )
                _freeze_startup_heap()
                yield
        finally:
            app.state.gateway = None
            app.state.adapter_registry = None
            app.state.tenancy = None
            app.state.body_parser = None
            scrape.close()
            engine.shutdown()

    app = FastAPI(title="loraplex", lifespan=lifespan)
    app.state.settings = settings
    app.state.gateway = None
    app.state.tenancy = None
    app.state.adapter_registry = None
    app.state.body_parser = None
    app.state.drain = Drain(settings.http.drain_s)
    metrics = GatewayMetrics(CollectorRegistry(), settings.tenancy.adapter_label_top_k)
    metrics.watch_queues(lambda: app.state.tenancy.queue_snapshot() if app.state.tenancy else {})
    metrics.watch_engine(lambda: app.state.gateway is not None and app.state.gateway.engine.healthy)
    activity = LoraActivity()
    picker = PickerMetrics(
        settings.engine.max_loras,
        activity,
        lambda: app.state.adapter_registry.tiers.residents() if app.state.adapter_registry else (),
    )
    metrics.live.register(picker)
    install_json_handler()
    # The last added runs first: access logging wraps the drain's gate and the body cap, so a
    # draining replica's 503 and a 413 are logged and counted.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.http.max_body_bytes,
        timeout_s=settings.http.body_timeout_s,
    )
    app.add_middleware(DrainGate, drain=app.state.drain)
    app.add_middleware(AccessLogMiddleware, metrics=metrics)
    app.add_middleware(MetricsListenerOnly, metrics_port=settings.http.metrics_port)
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(openai.vllm_router)
    app.include_router(health.router)
    app.include_router(admin_adapters.router)
    app.include_router(admin_tenants.router)
    app.include_router(fairness.router)

    # vLLM (and the adapter registry) register in prometheus_client's default registry; the
    # gateway's metrics, and the endpoint picker's under vLLM's names, live in this app's own
    # registry. Both are served here, to those metrics_access lets in.
    access = MetricsAccess(settings.http)
    if access.warning:
        log.warning(access.warning)
    scrape = MetricsScrape([EngineMetrics(REGISTRY, activity), metrics.live], [metrics.registry])

    @app.get(METRICS_PATH, include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        access.check(request.scope, request.headers.get("authorization"))
        return Response(await scrape.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get(PICKER_METRICS_PATH, include_in_schema=False)
    async def picker_metrics(request: Request) -> Response:
        access.check(request.scope, request.headers.get("authorization"))
        body = picker_exposition(REGISTRY, picker, activity)
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    return app
