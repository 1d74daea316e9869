"""API keys: generated once, stored only as salted hashes, verified in constant time.

A stored key is `(lookup_id, salt, digest)`. `lookup_id` is a short fingerprint of the key (the
first 16 hex digits of its sha256) that finds the candidate record in a dict without comparing
secrets; `digest = sha256(salt || key)` proves the key, compared with `hmac.compare_digest`. Keys
are 32 random bytes, so a fast hash is enough: a slow KDF (scrypt) protects guessable passwords,
and would add tens of milliseconds to every request's TTFT.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_PREFIX = "lpx-"


def new_key() -> str:
    """A fresh API key (shown to the caller once, never stored)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def lookup_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class HashedKey:
    """What is kept of a key. `key_id` names it in admin listings (safe to show)."""

    lookup_id: str
    salt: str
    digest: str

    @classmethod
    def of(cls, key: str) -> HashedKey:
        salt = secrets.token_hex(16)
        return cls(lookup_id(key), salt, _digest(salt, key))

    @property
    def key_id(self) -> str:
        return self.lookup_id[:8]

    def matches(self, key: str) -> bool:
        return hmac.compare_digest(self.digest, _digest(self.salt, key))

    def to_json(self) -> dict[str, str]:
        return {"lookup_id": self.lookup_id, "salt": self.salt, "digest": self.digest}

    @classmethod
    def from_json(cls, data: dict[str, str]) -> HashedKey:
        return cls(data["lookup_id"], data["salt"], data["digest"])


def _digest(salt: str, key: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + key.encode()).hexdigest()


def same_secret(a: str, b: str) -> bool:
    """Constant-time equality of two secrets (e.g. the admin token and a bearer)."""
    return hmac.compare_digest(a.encode(), b.encode())
