"""Tenancy's errors, as members of the gateway's one error hierarchy (`loraplex.server.errors`)."""

from __future__ import annotations

import math

from loraplex.adapters_registry.base import ErrorKind
from loraplex.server import errors


class Unauthorized(errors.Unauthenticated):
    """No key, an unknown key, or a key of the wrong kind (admin token on /v1 and the reverse)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class RateLimited(errors.RateLimited):
    """A per-tenant quota is exhausted; Retry-After says when it will admit again."""

    def __init__(self, message: str, *, reason: str, retry_after: float) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, math.ceil(retry_after)))})
        self.reason = reason
        self.retry_after = retry_after


class QueueFull(errors.EngineOverloaded):
    """The bounded global queue is full: the server as a whole is overloaded."""

    code = "queue_full"
    reason = "queue_full"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "1"})


class QuotaStoreUnavailable(errors.ApiError):
    """The shared quota store (tenancy.quota_store) is unreachable and
    tenancy.quota_store_failure is `closed`: no request is admitted until it is back."""

    kind = ErrorKind.UNAVAILABLE
    code = "quota_store_unavailable"
    reason = "quota_store_unavailable"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, math.ceil(retry_after)))})
        self.retry_after = retry_after


class TenantNotFound(errors.NotFound):
    code = "tenant_not_found"


class TenantConflict(errors.ApiError):
    """Creating a tenant that exists, or changing one defined in the config file."""

    kind = ErrorKind.CONFLICT
    code = "tenant_conflict"


class RequestTooLarge(errors.InvalidRequest):
    """A request that no wait can admit: it needs more than a limit holds in all (more choices
    than `tenancy.max_running`, more tokens than a minute of `tokens_per_minute`). A 400, not a
    429: a 429's Retry-After promises that waiting helps, and clients retry it on their own."""

    code = "request_too_large"

    def __init__(self, message: str, *, param: str | None, reason: str) -> None:
        super().__init__(message, param=param)
        self.reason = reason


class TenantStoreUnavailable(errors.ApiError):
    """A change to tenants could not be written to the store (it failed after retries, or
    other replicas kept writing first); nothing changed."""

    kind = ErrorKind.UNAVAILABLE
    code = "tenant_store_unavailable"
