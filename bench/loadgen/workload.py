"""The workload file: who sends what, how fast, for how long (YAML, validated here).

base_url: http://127.0.0.1:8000
duration_s: 60            # each tenant sends for this long (or until num_requests)
slo: {ttft_s: 2.0, tpot_s: 0.2}     # a request meeting both counts towards goodput
tenants:
  - name: a
    api_key: lpx-...      # or api_key_env: NAME_OF_ENV_VAR
    adapters: [a/bot]     # requests cycle through these; empty means the base model
    rate: 4.0             # Poisson arrivals per second ... or
    concurrency: 8        # ... a closed loop of this many users (exactly one of the two)
    prompt_len: 128       # prompt tokens (random token ids, seeded)
    output_len: 64        # generated tokens (ignore_eos, so every request makes exactly this)
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, model_validator


class Slo(BaseModel):
    ttft_s: float = Field(default=2.0, gt=0)
    tpot_s: float = Field(default=0.2, gt=0)


class TenantLoad(BaseModel):
    model_config = {"extra": "forbid"}

    name: str
    api_key: str | None = None
    api_key_env: str | None = None
    adapters: list[str | None] = Field(
        default_factory=list, description="Cycled through per request; null is the base model."
    )
    rate: float | None = Field(default=None, gt=0)
    concurrency: int | None = Field(default=None, ge=1)
    prompt_len: int = Field(default=128, ge=1)
    output_len: int = Field(default=64, ge=1)
    num_requests: int | None = Field(default=None, ge=1)
    start_after_s: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _one_arrival_mode(self) -> TenantLoad:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError(f"tenant {self.name}: give exactly one of `rate` and `concurrency`")
        return self

    def key(self) -> str:
        if self.api_key_env:
            value = os.environ.get(self.api_key_env)
            if not value:
                raise ValueError(f"tenant {self.name}: env var {self.api_key_env} is not set")
            return value
        return self.api_key or "none"


class Workload(BaseModel):
    model_config = {"extra": "forbid"}

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = Field(default=None, description="Base model name; default: first listed")
    duration_s: float = Field(default=30.0, gt=0)
    warmup_requests: int = Field(default=2, ge=0, description="Per tenant, not measured.")
    drain_s: float = Field(
        default=60.0,
        ge=0,
        description="After duration_s, wait this long for open requests, "
        "then cancel them (counted as errors with status 0, `abandoned`).",
    )
    seed: int = 0
    vocab_low: int = Field(default=1000, ge=0)
    vocab_high: int = Field(default=40000, ge=1)
    slo: Slo = Field(default_factory=lambda: Slo())
    tenants: list[TenantLoad] = Field(min_length=1)

    @classmethod
    def from_file(cls, path: Path) -> Workload:
        return cls.model_validate(yaml.safe_load(path.read_text()))
