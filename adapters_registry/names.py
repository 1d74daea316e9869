"""Adapter names and `name@version` references, checked before they touch a path or a key.

A name is one or two segments (`support-bot`, `acme/support-bot`: tenant namespace first). Each
segment starts with a letter or digit and holds letters, digits, `.`, `_`, `-`; `..` is refused
anywhere, so a name can never climb out of a directory or an object-store prefix. A new
registration may not take the base model's served name or a name the metrics reserve
(`check_new_name`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraplex.adapters_registry.base import AdapterConflict, AdapterInvalid

MAX_NAME_LEN = 128
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAME_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})?")
# Full sha256 hex, or an unambiguous prefix of at least 8 hex digits.
_VERSION_RE = re.compile(r"[0-9a-f]{8,64}")
# The values the gateway's metrics give the adapter label besides adapter names (requests to
# the base model, adapters past the label bound, requests refused before a model): an adapter
# registered under one of them would share their series (loraplex.server.metrics).
RESERVED_NAMES = frozenset({"base", "other", "none"})


@dataclass(frozen=True)
class AdapterRef:
    """What a request names: an adapter, optionally pinned to one version (prefix)."""

    name: str
    version: str | None = None


def check_name(name: str, *, param: str = "name") -> str:
    """Return `name` if it is a valid adapter name, else raise AdapterInvalid saying why."""
    if not name:
        raise AdapterInvalid("adapter name is empty", param=param, reason="name")
    if len(name) > MAX_NAME_LEN:
        raise AdapterInvalid(
            f"adapter name is {len(name)} characters; at most {MAX_NAME_LEN} allowed",
            param=param,
            reason="name",
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise AdapterInvalid("adapter name contains control characters", param=param, reason="name")
    if ".." in name:
        raise AdapterInvalid(f"adapter name {name!r} contains '..'", param=param, reason="name")
    if not _NAME_RE.fullmatch(name):
        raise AdapterInvalid(
            f"adapter name {name!r} is invalid: use one or two '/'-separated segments of "
            "letters, digits, '.', '_' or '-', each starting with a letter or digit "
            "(at most 64 characters each)",
            param=param,
            reason="name",
        )
    return name


def check_new_name(name: str, base_model: str, *, param: str = "name") -> str:
    """`check_name`, then refuse what a registration may not take: a name the metrics reserve
    (AdapterInvalid), and the base model's served name (AdapterConflict: requests naming it
    reach the base model, so such an adapter could never serve, and /v1/models would list the
    name twice)."""
    check_name(name, param=param)
    if name in RESERVED_NAMES:
        raise AdapterInvalid(
            f"adapter name {name!r} is reserved: the metrics' adapter label uses "
            f"{', '.join(sorted(RESERVED_NAMES))} for requests that name no single adapter",
            param=param,
            reason="name",
        )
    if name == base_model:
        raise AdapterConflict(
            f"adapter name {name!r} is the base model's served name: requests naming it "
            "are served by the base model",
            param=param,
        )
    return name


def parse_ref(text: str, *, param: str = "model") -> AdapterRef:
    """Parse `name` or `name@version`; raise AdapterInvalid if either part is malformed."""
    name, sep, version = text.partition("@")
    check_name(name, param=param)
    if not sep:
        return AdapterRef(name)
    if not _VERSION_RE.fullmatch(version):
        raise AdapterInvalid(
            f"version {version!r} is invalid: give 8 to 64 lowercase hex digits of the sha256",
            param=param,
            reason="name",
        )
    return AdapterRef(name, version)
