"""Schemathesis hooks for bench.schemathesis_run (loaded through SCHEMATHESIS_HOOKS).

Generated strings almost never name a model, an adapter source or a tenant that exists, so
nearly every request would stop at a 404 before the engine or the registry does any work. Each
hook offers, beside the generated value, the real ones (from SCHEMATHESIS_LORAPLEX, a JSON object
the runner sets): Hypothesis then draws either, so half the generated requests reach the engine,
the registry's fetch and validation, or an existing tenant or adapter.
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis
from hypothesis import strategies as st

REAL = json.loads(os.environ.get("SCHEMATHESIS_LORAPLEX", "{}"))


def _path(context: Any) -> str:
    return str(getattr(context.operation, "path", ""))


def _either(value: Any, key: str, real: list[Any]) -> st.SearchStrategy[Any]:
    return st.sampled_from([value, *({**value, key: r} for r in real)])


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> st.SearchStrategy[Any]:
    if not isinstance(body, dict):
        return st.just(body)
    if _path(context).startswith("/v1/") and "model" in body:
        return _either(body, "model", REAL.get("models", []))
    if _path(context) == "/admin/v1/adapters" and "source" in body:
        return _either(body, "source", REAL.get("sources", []))
    return st.just(body)


@schemathesis.hook
def flatmap_path_parameters(context: Any, parameters: Any) -> st.SearchStrategy[Any]:
    if not isinstance(parameters, dict):
        return st.just(parameters)
    for key, real in (("name", REAL.get("adapters", [])), ("tenant_id", REAL.get("tenants", []))):
        if key in parameters:
            return _either(parameters, key, real)
    return st.just(parameters)
