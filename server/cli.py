"""The `loraplex` command: `loraplex serve` runs the gateway (the embedded demo by default)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from loraplex.server import adapters_cli
from loraplex.server.settings import ConfigError, load_settings


def _vllm_args(pairs: list[str]) -> dict[str, Any]:
    """`--vllm-arg KEY=VALUE` flags as engine.vllm_args; VALUE is read as YAML (8, true, a JSON
    object), as the settings file would give it."""
    args = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--vllm-arg {pair!r}: expected KEY=VALUE")
        try:
            args[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--vllm-arg {key.strip()}: the value is not YAML: {e}") from None
    return args


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags become settings overrides; unset flags leave env/config-file values alone."""
    engine = {
        k: v for k, v in {"model": args.model, "max_loras": args.max_loras}.items() if v is not None
    }
    if args.vllm_arg:
        engine["vllm_args"] = _vllm_args(args.vllm_arg)
    http = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    registry = {"local_dir": args.adapters_dir} if args.adapters_dir else {}
    overrides: dict[str, Any] = {}
    for section, values in (("engine", engine), ("http", http), ("registry", registry)):
        if values:
            overrides[section] = values
    return overrides


def serve(args: argparse.Namespace) -> int:
    from loraplex.server import serving
    from loraplex.server.app import create_app
    from loraplex.server.engine.builder import parse_vllm_args

    try:
        settings = load_settings(**_serve_overrides(args))
        parse_vllm_args(settings.engine)  # before the engine's start, which takes minutes
    except ConfigError as e:
        print(f"loraplex: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.http.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    serving.run(create_app(settings), settings.http)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument(
        "--model", help="model directory or Hub id org/name[@revision] (default: embedded)"
    )
    p.add_argument("--adapters-dir", type=Path, help="folder with one subfolder per adapter")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default 8000)")
    p.add_argument("--max-loras", type=int, help="adapters per batch")
    p.add_argument(
        "--vllm-arg",
        action="append",
        metavar="KEY=VALUE",
        help="any vLLM engine or serving argument (engine.vllm_args), e.g. "
        "enable_prefix_caching=true; repeatable",
    )
    p.set_defaults(handler=serve)
    adapters_cli.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
