"""`loraplex adapters ...`: the admin API from a shell, and `push` to upload an adapter to S3.

    loraplex adapters push ./my-adapter s3://bucket/adapters/my-adapter/ [--register acme/bot]
    loraplex adapters register acme/bot s3://bucket/adapters/my-adapter/ [--warm] [--pinned]
    loraplex adapters register acme/bot hf://acme/loras@main/bot   (also a local directory)
    loraplex adapters list | get NAME | pin NAME | unpin NAME | delete NAME
    loraplex adapters evict NAME --tier cpu|disk | rollback NAME [--version V]
    loraplex adapters quarantine NAME --reason WHY [--version V] | unquarantine NAME [--version V]

The server address and admin token come from `--url`/`--admin-token`, else from the settings
(`http.host`, `http.port`, `http.admin_token`); S3 endpoint and retries from `registry.*`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from loraplex.adapters_registry.s3_store import make_s3_client, make_transfer_config
from loraplex.adapters_registry.store import split_s3_uri
from loraplex.adapters_registry.validation import ADAPTER_FILES
from loraplex.server.settings import ConfigError, Settings, load_settings


class CliError(Exception):
    """A failure to report on stderr with exit status 1."""


def _client(args: argparse.Namespace, settings: Settings) -> httpx.Client:
    url = args.url or f"http://{settings.http.host}:{settings.http.port}"
    token = args.admin_token or (
        settings.http.admin_token.get_secret_value() if settings.http.admin_token else None
    )
    if not token:
        raise CliError("no admin token: pass --admin-token or set LORAPLEX_HTTP__ADMIN_TOKEN")
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=600)


def _call(args: argparse.Namespace, settings: Settings, method: str, path: str,
          body: dict[str, Any] | None = None) -> Any:  # fmt: skip
    with _client(args, settings) as client:
        try:
            response = client.request(method, f"/admin/v1/adapters{path}", json=body)
        except httpx.HTTPError as e:
            raise CliError(f"cannot reach {client.base_url}: {e}") from e
    payload = response.json()
    if response.is_error:
        error = payload.get("error", {})
        raise CliError(f"{response.status_code} {error.get('code')}: {error.get('message')}")
    return payload


def push(args: argparse.Namespace, settings: Settings) -> Any:
    """Upload DIR's adapter files to an S3 prefix with a progress bar, then optionally register."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    folder: Path = args.dir
    missing = [f for f in ADAPTER_FILES if not (folder / f).is_file()]
    if missing:
        raise CliError(f"{folder} lacks {', '.join(missing)} (a PEFT adapter in safetensors)")
    try:
        bucket, prefix = split_s3_uri(args.dest)
    except ValueError as e:
        raise CliError(str(e)) from e
    registry = settings.registry
    if args.endpoint_url:
        registry = registry.model_copy(update={"s3_endpoint_url": args.endpoint_url})
    client, config = make_s3_client(registry), make_transfer_config(registry)
    total = sum((folder / f).stat().st_size for f in ADAPTER_FILES)
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
    # The bar goes to stderr so stdout stays the JSON result.
    with Progress(*columns, console=Console(stderr=True), disable=args.quiet) as progress:
        task = progress.add_task(f"push {folder.name}", total=total)
        for name in ADAPTER_FILES:
            key = f"{prefix}/{name}" if prefix else name
            client.upload_file(
                str(folder / name), bucket, key, Config=config,
                Callback=lambda n: progress.update(task, advance=n),
            )  # fmt: skip
    source = f"s3://{bucket}/{prefix}/" if prefix else f"s3://{bucket}/"
    if args.register:
        return _call(args, settings, "POST", "", {"name": args.register, "source": source})
    return {"pushed": source, "bytes": total}


_COMMANDS: dict[str, Any] = {
    "list": lambda a, s: _call(a, s, "GET", ""),
    "get": lambda a, s: _call(a, s, "GET", f"/{a.name}"),
    "register": lambda a, s: _call(a, s, "POST", "", {
        "name": a.name, "source": a.source, "warm": a.warm, "pinned": a.pinned}),
    "pin": lambda a, s: _call(a, s, "POST", f"/{a.name}/pin"),
    "unpin": lambda a, s: _call(a, s, "POST", f"/{a.name}/unpin"),
    "evict": lambda a, s: _call(a, s, "POST", f"/{a.name}/evict", {"tier": a.tier}),
    "rollback": lambda a, s: _call(a, s, "POST", f"/{a.name}/rollback", {"version": a.version}),
    "delete": lambda a, s: _call(a, s, "DELETE", f"/{a.name}"),
    "quarantine": lambda a, s: _call(a, s, "POST", f"/{a.name}/quarantine", {
        "reason": a.reason, "version": a.version}),
    "unquarantine": lambda a, s: _call(a, s, "POST", f"/{a.name}/unquarantine", {
        "version": a.version}),
    "push": push,
}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        result = _COMMANDS[args.adapters_command](args, load_settings())
    except (CliError, ConfigError) as e:
        print(f"loraplex adapters: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


def add_parser(subparsers: Any) -> None:
    """Add the `adapters` command to the `loraplex` parser's sub-commands."""
    parser = subparsers.add_parser("adapters", help="manage adapters through the admin API")
    parser.add_argument("--url", help="server base URL (default from http.host/http.port)")
    parser.add_argument("--admin-token", help="admin token (default http.admin_token)")
    commands = parser.add_subparsers(dest="adapters_command", required=True)
    commands.add_parser("list", help="list registered adapters")
    for name, help_ in (
        ("get", "show one adapter"), ("pin", "keep in a GPU slot"),
        ("unpin", "release the GPU pin"), ("delete", "unregister"),
    ):  # fmt: skip
        commands.add_parser(name, help=help_).add_argument("name")
    p = commands.add_parser("register", help="register an adapter from S3, the Hub or a folder")
    p.add_argument("name")
    p.add_argument("source", help="s3://bucket/prefix/, hf://org/name[@rev][/folder] or a folder")
    p.add_argument("--warm", action="store_true", help="load into the engine now")
    p.add_argument("--pinned", action="store_true", help="pin to a GPU slot")
    p = commands.add_parser("evict", help="drop from a tier on the server answering")
    p.add_argument("name")
    p.add_argument("--tier", choices=["cpu", "disk"], required=True)
    p = commands.add_parser("rollback", help="point the name at its previous version")
    p.add_argument("name")
    p.add_argument("--version", help="a version it had before (default: the previous one)")
    p = commands.add_parser("quarantine", help="take a version out of service (all replicas)")
    p.add_argument("name")
    p.add_argument("--reason", required=True, help="why (shown to requests naming it)")
    p.add_argument("--version", help="a version of it (default: the current one)")
    p = commands.add_parser("unquarantine", help="let a quarantined version serve again")
    p.add_argument("name")
    p.add_argument("--version", help="a version of it (default: the current one)")
    p = commands.add_parser("push", help="upload an adapter folder to S3 with a progress bar")
    p.add_argument("dir", type=Path, help="folder with adapter_config.json + .safetensors")
    p.add_argument("dest", help="s3://bucket/prefix/")
    p.add_argument("--register", metavar="NAME", help="then register it under NAME")
    p.add_argument("--endpoint-url", help="S3 endpoint (default registry.s3_endpoint_url)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)
