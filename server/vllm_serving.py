"""vLLM's OpenAI serving objects over loraplex's engine: docs/architecture.md says why.

`build_serving` builds `OpenAIServingChat`, `OpenAIServingCompletion` and `ServingTokenization` as
vLLM's `init_app_state` does, from the same `vllm serve` namespace the engine was built from, with
two loraplex pieces underneath:
- `EngineView`, the engine client they are given: AsyncLLM in every respect but `generate`,
  which runs the engine's own input checks and hands the call to the current `ServedRequest`
  (tenancy, the adapter's lease, the guarded engine stream);
- `AdapterNames`, their models object's `lora_requests`: the registry's adapter names.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.adapters_registry.base import AdapterError, AdapterSource
from loraplex.server.engine import vllm_compat
from loraplex.server.engine.client import EngineClient, as_invalid_request
from loraplex.server.errors import InvalidRequest
from loraplex.server.served_request import CURRENT, ServedRequest

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.lora.request import LoRARequest


class EngineView:
    """The engine client vLLM's serving objects call: every attribute is AsyncLLM's, except
    `generate`."""

    def __init__(self, engine: EngineClient, supported_tasks: tuple[str, ...]) -> None:
        self._engine = engine
        self._async_llm = engine.async_llm
        self._supported_tasks = supported_tasks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._async_llm, name)

    def generate(
        self,
        prompt: Mapping[str, Any],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        data_parallel_rank: int | None = None,
        **vllm_kwargs: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The current request's stream for this prompt. The adapter (`lora_request` only names
        it here), the priority and the rest that tenancy decides are the request's; vLLM's other
        keyword arguments (reasoning state) pass through. Raises vLLM's input errors now."""
        del lora_request, priority, trace_headers, data_parallel_rank
        served = CURRENT.get()
        if served is None:
            raise RuntimeError("generate outside a loraplex request (served_request.as_current)")
        self._check(served, prompt, sampling_params, request_id)
        return served.submit(prompt, sampling_params, request_id, vllm_kwargs)

    def _check(
        self, served: ServedRequest, prompt: Mapping[str, Any], params: SamplingParams, rid: str
    ) -> None:
        """The checks AsyncLLM.generate runs once the stream starts (logit_bias in the
        vocabulary, structured outputs that compile, the prompt, ...), run now, each error named
        by the request field it concerns. The engine's result is dropped; it builds its own."""
        ids = prompt.get("prompt_token_ids") or []
        vocab = len(self._engine.tokenizer)
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param=served.prompt_field)
        if params.structured_outputs is not None:
            try:
                vllm_compat.check_structured_outputs(self._async_llm, params)
            except Exception as e:
                raise InvalidRequest(str(e), param=served.constrained_by) from e
        try:
            checks: Any = self._async_llm.input_processor
            checks.process_inputs(rid, prompt, params, self._supported_tasks)
        except Exception as e:
            # vLLM names the sampling fields it refuses; its prompt checks name none.
            if getattr(e, "parameter", None) is None and as_invalid_request(e) is not None:
                raise InvalidRequest(str(e), param=served.prompt_field) from e
            raise


class AdapterNames(dict[str, Any]):
    """`OpenAIServingModels.lora_requests` answered by the registry: `name in` it is true for a
    registered adapter, and its item is a `LoRARequest` that only names the adapter (the real
    one, `name@version`, comes with the lease after the fair turn). Iteration yields nothing:
    vLLM iterates these only to attach an adapter named like a message's content type (`text`,
    `image`) to requests for the base model, which loraplex never does."""

    def __init__(self, adapters: AdapterSource) -> None:
        super().__init__()
        self._adapters = adapters

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self._adapters.resolve(name)
        except AdapterError:
            return False
        return True

    def __getitem__(self, name: str) -> LoRARequest:
        from vllm.lora.request import LoRARequest

        if name not in self:
            raise KeyError(name)
        # vLLM asks for an id and a path; this request is never sent to the engine.
        return LoRARequest(lora_name=name, lora_int_id=1, lora_path=f"loraplex:{name}")


@dataclass(frozen=True)
class VllmServing:
    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    tokenization: ServingTokenization


def build_serving(
    view: EngineView,
    namespace: argparse.Namespace,
    model_dir: Path,
    served_name: str,
    adapters: AdapterSource,
) -> VllmServing:
    """vLLM's serving objects as `init_app_state` builds them from `vllm serve`'s arguments."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.entrypoints.serve.utils.request_logger import RequestLogger
    from vllm.renderers.online_renderer import OnlineRenderer

    ns = namespace
    engine: Any = view
    models = OpenAIServingModels(
        engine_client=engine,
        base_model_paths=[BaseModelPath(name=served_name, model_path=str(model_dir))],
    )
    models.lora_requests = AdapterNames(adapters)
    # vLLM's own request log (prompts included), as `vllm serve --enable-log-requests` keeps it.
    logger = RequestLogger(max_log_len=ns.max_log_len) if ns.enable_log_requests else None
    chat_template = vllm_compat.load_chat_template(ns.chat_template)
    common = {
        "request_logger": logger,
        "chat_template": chat_template,
        "chat_template_content_format": ns.chat_template_content_format,
        "trust_request_chat_template": ns.trust_request_chat_template,
        "default_chat_template_kwargs": vllm_compat.default_chat_template_kwargs(ns),
        "enable_auto_tools": ns.enable_auto_tool_choice,
        "exclude_tools_when_tool_choice_none": ns.exclude_tools_when_tool_choice_none,
        "tool_parser": ns.tool_call_parser,
        "tool_strict_level": getattr(ns, "tool_strict_level", None),
        "reasoning_parser": view.vllm_config.structured_outputs_config.reasoning_parser,
    }
    renderer_args = {
        **common,
        "model_config": view.model_config,
        "renderer": view.renderer,
        "trust_request_mm_kwargs": getattr(ns, "trust_request_mm_kwargs", False),
        "log_error_stack": ns.log_error_stack,
    }
    renderer = OnlineRenderer(**vllm_compat.accepted_kwargs(OnlineRenderer, renderer_args))
    outputs = {
        "return_tokens_as_token_ids": ns.return_tokens_as_token_ids,
        "enable_prompt_tokens_details": ns.enable_prompt_tokens_details,
        "enable_force_include_usage": ns.enable_force_include_usage,
        "enable_per_request_metrics": ns.enable_per_request_metrics,
    }
    chat_args = {
        **common,
        **outputs,
        "engine_client": engine,
        "models": models,
        "response_role": ns.response_role,
        "online_renderer": renderer,
        "enable_log_outputs": ns.enable_log_outputs,
        "enable_log_deltas": ns.enable_log_deltas,
    }
    chat = OpenAIServingChat(**vllm_compat.accepted_kwargs(OpenAIServingChat, chat_args))
    completion = OpenAIServingCompletion(
        engine,
        models,
        **vllm_compat.accepted_kwargs(
            OpenAIServingCompletion,
            {**outputs, "online_renderer": renderer, "request_logger": logger},
        ),
    )
    tokenization = ServingTokenization(
        models,
        renderer,
        **vllm_compat.accepted_kwargs(ServingTokenization, common),
    )
    vllm_compat.warm_up(renderer, chat)
    return VllmServing(chat, completion, tokenization)
