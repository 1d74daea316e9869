"""Per-tenant prefix-cache salts: a prompt that matches another tenant's never hits its blocks.

vLLM reuses the KV blocks of any earlier prompt with the same prefix, and a hit shows: one
tenant's first token came in 0.3 s instead of 2.75 s when its prompt matched another's, which
tells it what the other sent. vLLM keys each prompt's first block with the request's `cache_salt`
(a field of the prompt in vLLM 0.26 and 0.32; chained into every later block's hash), so requests
of different salts share nothing, while a tenant's own requests, and those of a group the operator
opted into sharing (`tenancy.share_prefix_cache`), still do.

A salt is HMAC-SHA256 over the tenant's (or its group's) id, keyed with 32 random bytes drawn when
the process starts: nothing outside the process can compute another tenant's salt, and clients
cannot send one (unknown request fields are refused). The key dies with the process, as the
engine's cache does.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


class CacheSalts:
    def __init__(self, groups: dict[str, list[str]], key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)
        self._group_of = {tenant: group for group, members in groups.items() for tenant in members}

    def of(self, tenant_id: str) -> str:
        """The salt of the tenant's requests: 64 hex digits (vLLM takes up to 128 characters)."""
        group = self._group_of.get(tenant_id)
        scope = f"group:{group}" if group is not None else f"tenant:{tenant_id}"
        return hmac.new(self._key, scope.encode(), hashlib.sha256).hexdigest()
