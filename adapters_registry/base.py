"""The contract between the gateway and whatever supplies adapters.

The server resolves the `model` of each request through an `AdapterSource`. A source answers with a
`ServableAdapter`: a local directory vLLM can load plus the engine id that belongs to exactly that
version's bytes (vLLM keeps serving old weights if an id is reused for another path, so ids are
never recycled for different content).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol


class ErrorKind(StrEnum):
    """What kind of failure an error is, for whoever answers it: the gateway maps each kind to
    one HTTP status and OpenAI error type, in one table (`loraplex.server.errors`)."""

    INVALID = "invalid"
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    TIMEOUT = "timeout"
    CONFLICT = "conflict"
    TOO_LARGE = "too_large"
    UNPROCESSABLE = "unprocessable"
    HEADERS_TOO_LARGE = "headers_too_large"
    RATE_LIMITED = "rate_limited"
    CLIENT_CLOSED = "client_closed"
    INTERNAL = "internal"
    NOT_IMPLEMENTED = "not_implemented"
    UNAVAILABLE = "unavailable"


class AdapterError(Exception):
    """Base of the registry's errors; `kind` says how the gateway answers it."""

    kind = ErrorKind.INTERNAL
    code = "adapter_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class AdapterNotFound(AdapterError):
    """No adapter of that name (or the caller may not see it: the two are indistinguishable)."""

    kind = ErrorKind.NOT_FOUND
    code = "model_not_found"


class AdapterUnavailable(AdapterError):
    """The adapter exists but cannot be made servable now (e.g. its store is failing)."""

    kind = ErrorKind.UNAVAILABLE
    code = "adapter_unavailable"


class AdapterInvalid(AdapterError):
    """A name, request or adapter's files are invalid; the message names the field and the bound."""

    kind = ErrorKind.INVALID
    code = "invalid_adapter"

    def __init__(self, message: str, *, param: str | None = None, reason: str = "invalid") -> None:
        super().__init__(message, param=param)
        self.reason = reason
        """A short fixed label (metrics): e.g. `rank`, `tensor_shape`, `pickle`, `name`,
        `untargeted_module`."""


class AdapterQuarantined(AdapterError):
    """The version a request names is quarantined: it made the engine produce non-finite values
    (or an admin took it out of service). A client error that retrying will not fix: it holds
    until an admin registers a new version, rolls the name back or clears the quarantine. 422,
    not 409, because clients (OpenAI's SDKs among them) retry a 409 as a transient conflict."""

    kind = ErrorKind.UNPROCESSABLE
    code = "adapter_quarantined"


class AdapterNotApplied(AdapterError):
    """The version a request names has LoRA on a module this replica's engine leaves unwrapped
    (its `lora_target_modules`): registered before that restriction, or by a replica without
    it. vLLM would serve it without that LoRA, silently. 422 as a quarantine: retrying here
    will not fix it; a version without the module, or an engine that wraps it, will."""

    kind = ErrorKind.UNPROCESSABLE
    code = "adapter_not_applied"


class AdapterConflict(AdapterError):
    """The operation contradicts the catalog's state (e.g. rollback with no earlier version)."""

    kind = ErrorKind.CONFLICT
    code = "adapter_conflict"


@dataclass(frozen=True)
class ServableAdapter:
    """One version of an adapter, on local disk, ready for vLLM's `LoRARequest`."""

    name: str
    version: str
    engine_id: int
    path: Path
    rank: int


class AdapterSource(Protocol):
    """Supplies adapters by name. Implementations must be safe to call from many tasks at once."""

    def lease(self, name: str) -> AbstractAsyncContextManager[ServableAdapter]:
        """Make `name` servable and hold it for the duration of one request.

        Raises AdapterNotFound if there is no such adapter, AdapterUnavailable if it cannot be
        fetched or loaded, AdapterQuarantined if it is quarantined, AdapterNotApplied if the
        engine would leave part of its LoRA out. While a lease is held, the
        version it returned is not deleted and stays in the engine, quarantined or not.
        """
        ...

    def names(self) -> list[str]:
        """Names of every adapter that can currently be served (no side effects)."""
        ...

    def resolve(self, name: str) -> object:
        """Raises AdapterNotFound if `name` names no adapter, AdapterQuarantined if the version
        it names is quarantined (no side effects; cheap)."""
        ...

    async def prefetch(self, name: str) -> None:
        """Make `name`'s files local without holding any engine resource, so that a later
        `lease` only loads them. Raises AdapterNotFound, AdapterUnavailable."""
        ...

    async def quarantine(self, name: str, version: str, reason: str) -> None:
        """Take version `version` of adapter `name` out of service on every replica, because of
        `reason` (one line; longer text is cut to 200 characters): from the call on, requests
        naming it get AdapterQuarantined (422 `adapter_quarantined`) and it takes no new lease;
        it leaves the engine (GPU slot, CPU cache) once the leases held on it end, so the
        caller may hold one. Counted in `loraplex_adapter_quarantines_total`, logged once.

        Idempotent (a version already quarantined: nothing happens) and never raises: an
        unknown or deleted version is logged and ignored; a catalog write that fails holds on
        this replica and is retried at each poll until the catalog has it. It lasts until an
        admin clears it (POST /admin/v1/adapters/{name}/unquarantine), registers new bytes
        under the name or rolls it back to another version."""
        ...
