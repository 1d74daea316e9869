"""The one object that talks to vLLM's AsyncLLM: start, stream, abort, LoRA control, health.

Contract:
- `generate` yields `RequestOutputKind.DELTA` outputs (only what is new since the last one). If the
  caller stops iterating (client gone, task cancelled, error), the engine request is aborted before
  the generator closes, so no request is left running in the engine.
- Engine ids are owned here: an id once bound to an adapter version is never bound to another
  (vLLM silently keeps serving the old weights if an id is reused for a different path).
- Engine death is sticky: `healthy` turns False and every later call raises `EngineUnavailable`.
- An output whose logits were not finite is never yielded: `generate` raises `OutputNotFinite`
  (`AdapterOutputNotFinite` for an adapter's request) and aborts the request (finite_guard.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.adapters_registry.base import ServableAdapter
from loraplex.server.engine.builder import (
    engine_args,
    export_engine_environment,
    on_cpu,
    vllm_namespace,
)
from loraplex.server.engine.finite_guard import FiniteGuard
from loraplex.server.errors import EngineUnavailable, InvalidRequest
from loraplex.server.settings import EngineSettings

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


def as_invalid_request(error: Exception) -> InvalidRequest | None:
    """The 400 for an error that is vLLM's verdict that the request itself is bad; None for a
    server fault."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # vLLM 0.26 raises ValueError for bad input
        client_errors: tuple[type[Exception], ...] = (ValueError,)
    else:  # VLLMValidationError is no ValueError
        client_errors = (ValueError, VLLMValidationError)
    if not isinstance(error, client_errors):
        return None
    return InvalidRequest(str(error), param=getattr(error, "parameter", None))


def _retire_lora_requests_info(engine: AsyncLLM) -> None:
    """Stop vLLM's Prometheus logger from updating its `vllm:lora_requests_info` and take the
    gauge out of the default registry: loraplex serves its own (server/picker_metrics.py says
    why), and vLLM's would keep a series for every combination of adapters ever seen."""
    from prometheus_client import REGISTRY

    manager = getattr(engine, "logger_manager", None)
    for stat_logger in getattr(manager, "stat_loggers", ()):
        gauge = getattr(stat_logger, "gauge_lora_info", None)
        if gauge is not None:
            stat_logger.gauge_lora_info = None  # vLLM checks for None before each update
            with contextlib.suppress(KeyError):  # already unregistered
                REGISTRY.unregister(gauge)


class EngineIdConflict(RuntimeError):
    """An engine id was offered for a second, different adapter version."""


class EngineClient:
    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer: Any,
        max_model_len: int,
        namespace: argparse.Namespace | None = None,
    ) -> None:
        self._engine = engine
        self.on_cpu = on_cpu()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # The `vllm serve` arguments the engine was built from; vLLM's serving objects take them.
        self.namespace = namespace or argparse.Namespace()
        self._bound_ids: dict[int, tuple[str, str, Path]] = {}

    @classmethod
    async def start(
        cls, settings: EngineSettings, model_dir: Path, served_name: str
    ) -> EngineClient:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        export_engine_environment(settings)
        namespace = vllm_namespace(settings, model_dir, served_name)
        # As `vllm serve` builds its engine: vLLM sizes the unset step budget by this context,
        # 8,192 tokens on an H100 or H200 for its server against the 2,048 that AsyncLLM's own
        # default context gets (vllm/engine/arg_utils.py, get_batch_defaults).
        engine = AsyncLLM.from_engine_args(
            engine_args(settings, namespace), usage_context=UsageContext.OPENAI_API_SERVER
        )
        _retire_lora_requests_info(engine)
        tokenizer = engine.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # vLLM < 0.30 made this a coroutine
            tokenizer = await tokenizer
        return cls(engine, tokenizer, settings.max_model_len, namespace)

    def shutdown(self) -> None:
        self._engine.shutdown()

    @property
    def vllm_config(self) -> Any:
        """The engine's whole configuration as vLLM resolved it."""
        return self._engine.vllm_config

    @property
    def async_llm(self) -> AsyncLLM:
        """vLLM's engine itself, for vLLM's serving objects (`vllm_serving.EngineView`)."""
        return self._engine

    # --- health --------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return not self._engine.errored

    def unfinished_requests(self) -> int:
        """Requests the engine front end still tracks (vLLM's own count)."""
        return int(self._engine.output_processor.get_num_unfinished_requests())

    def _raise_if_dead(self) -> None:
        if self._engine.errored:
            raise EngineUnavailable("The inference engine is not running.") from (
                self._engine.dead_error
            )

    # --- generation ----------------------------------------------------------------------
    async def generate(
        self,
        prompt: list[int] | Mapping[str, Any],
        sampling_params: SamplingParams,
        adapter: ServableAdapter | None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        **vllm_kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """`prompt`: token ids, or the prompt vLLM's renderer made. `cache_salt` keys the
        prompt's prefix-cache blocks: prompts of different salts share none (the tenant's salt,
        `tenancy/cache_salt.py`). `vllm_kwargs` go to AsyncLLM.generate as they are (the
        reasoning parser's state)."""
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        lora = self.lora_request(adapter) if adapter else None
        guard = FiniteGuard(sampling_params, adapter)
        engine_input: dict[str, Any] = (
            {"prompt_token_ids": prompt} if isinstance(prompt, list) else dict(prompt)
        )
        if cache_salt is not None:
            engine_input["cache_salt"] = cache_salt
        stream = self._engine.generate(
            engine_input,  # type: ignore[arg-type]
            guard.params,
            request_id,
            lora_request=lora,
            priority=priority,
            **vllm_kwargs,
        )
        finished = False
        try:
            async for output in stream:
                guard.check(output)  # a non-finite row fails this request (aborted below)
                finished = output.finished
                yield output
        except Exception as e:
            if self._engine.errored:
                raise EngineUnavailable("The inference engine stopped.") from e
            if (invalid := as_invalid_request(e)) is not None:  # vLLM's input checks
                raise invalid from e
            raise
        finally:
            if not finished:
                # Shielded: the caller may be cancelled, but the abort must still reach the engine.
                await asyncio.shield(self._abort(request_id))
            await stream.aclose()

    async def _abort(self, request_id: str) -> None:
        try:
            await self._engine.abort(request_id)
        except Exception:  # the engine may already be dead; nothing left to abort then
            log.warning("abort of request %s failed", request_id, exc_info=True)

    # --- LoRA control (used by the adapter registry's tier manager) -----------------------
    def lora_request(self, adapter: ServableAdapter) -> LoRARequest:
        from vllm.lora.request import LoRARequest

        binding = (adapter.name, adapter.version, adapter.path)
        bound = self._bound_ids.setdefault(adapter.engine_id, binding)
        if bound[1] != adapter.version or bound[2] != adapter.path:
            raise EngineIdConflict(
                f"engine id {adapter.engine_id} is bound to {bound[0]}@{bound[1]}; "
                f"refusing to reuse it for {adapter.name}@{adapter.version}"
            )
        return LoRARequest(
            lora_name=f"{adapter.name}@{adapter.version}",
            lora_int_id=adapter.engine_id,
            lora_path=str(adapter.path),
        )

    async def add_lora(self, adapter: ServableAdapter) -> None:
        self._raise_if_dead()
        await self._engine.add_lora(self.lora_request(adapter))

    async def remove_lora(self, engine_id: int) -> None:
        self._raise_if_dead()
        await self._engine.remove_lora(engine_id)

    async def pin_lora(self, engine_id: int) -> None:
        self._raise_if_dead()
        await self._engine.pin_lora(engine_id)

    async def list_loras(self) -> set[int]:
        self._raise_if_dead()
        return set(await self._engine.list_loras())
