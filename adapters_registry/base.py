"""The contract between the gateway and whatever supplies adapters.

The server resolves the `model` of each request through an `AdapterSource`. A source answers with a
`ServableAdapter`: a local directory vLLM can load plus the engine id that belongs to exactly that
version's bytes (vLLM keeps serving old weights if an id is reused for another path, so ids are
never recycled for different content).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class AdapterError(Exception):
    """Base of the registry's errors. `http_status` is what the gateway should answer."""

    http_status = 500
    code = "adapter_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class AdapterNotFound(AdapterError):
    """No adapter of that name (or the caller may not see it: the two are indistinguishable)."""

    http_status = 404
    code = "model_not_found"


class AdapterUnavailable(AdapterError):
    """The adapter exists but cannot be made servable now (e.g. its store is failing)."""

    http_status = 503
    code = "adapter_unavailable"


class AdapterInvalid(AdapterError):
    """A name, request or adapter's files are invalid; the message names the field and the bound."""

    http_status = 400
    code = "invalid_adapter"

    def __init__(self, message: str, *, param: str | None = None, reason: str = "invalid") -> None:
        super().__init__(message, param=param)
        self.reason = reason
        """A short fixed label (metrics): e.g. `rank`, `tensor_shape`, `pickle`, `name`."""


class AdapterConflict(AdapterError):
    """The operation contradicts the catalog's state (e.g. rollback with no earlier version)."""

    http_status = 409
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
        fetched or loaded. While a lease is held, the version it returned is not deleted.
        """
        ...

    def names(self) -> list[str]:
        """Names of every adapter that can currently be served (no side effects)."""
        ...

    def resolve(self, name: str) -> object:
        """Raises AdapterNotFound if `name` names no adapter (no side effects; cheap)."""
        ...

    async def prefetch(self, name: str) -> None:
        """Make `name`'s files local without holding any engine resource, so that a later
        `lease` only loads them. Raises AdapterNotFound, AdapterUnavailable."""
        ...
