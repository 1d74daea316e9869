"""Where each request the gateway holds stands, by the adapter name clients send: what the
endpoint picker's LoRA lists and queue gauge are made of (`picker_metrics`).

A request passes three phases, in order, and is counted in exactly one at a time:

- `GATEWAY`: admitted, not yet handed to the engine (in the fair queue, fetching its adapter
  from the object store, loading it into the engine's CPU cache);
- `ENGINE`: handed to the engine, no output yet (in vLLM's waiting queue, or prefilling);
- `RUNNING`: the engine has produced its first output, so its adapter sits in a GPU slot.

vLLM's own per-LoRA states cannot tell the middle phase apart: its engine core reports a
request's QUEUED and SCHEDULED events only with the request's first output, so its waiting list
is empty except for preempted requests, and the lists it publishes name every adapter in both
(llm-d-router #2605). The gateway sees each request's whole life, which is why loraplex counts.

Counts change on the event loop only; reading them is a dictionary walk per scrape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

from loraplex.server.metrics import adapter_name


class Phase(Enum):
    GATEWAY = "gateway"
    ENGINE = "engine"
    RUNNING = "running"


class RequestActivity:
    """One request's place in `LoraActivity`; moves forward only (`enter` of an earlier or the
    same phase does nothing, so a caller may call it on every output)."""

    def __init__(self, activity: LoraActivity, adapter: str | None, sequences: int) -> None:
        self._activity = activity
        self.adapter = adapter
        self.sequences = sequences
        self.phase = Phase.GATEWAY
        activity._count(self, 1)

    def enter(self, phase: Phase) -> None:
        if _ORDER[phase] <= _ORDER[self.phase]:
            return
        self._activity._count(self, -1)
        self.phase = phase
        self._activity._count(self, 1)

    def leave(self) -> None:
        self._activity._count(self, -1)


_ORDER = {phase: i for i, phase in enumerate(Phase)}


class LoraActivity:
    def __init__(self) -> None:
        self._adapters: dict[Phase, Counter[str]] = {phase: Counter() for phase in Phase}
        self._sequences: Counter[Phase] = Counter()

    def _count(self, request: RequestActivity, sign: int) -> None:
        self._sequences[request.phase] += sign * request.sequences
        if request.adapter is not None:
            counts = self._adapters[request.phase]
            counts[request.adapter] += sign
            if counts[request.adapter] == 0:
                del counts[request.adapter]

    @contextmanager
    def track(self, model_adapter: str | None, sequences: int) -> Iterator[RequestActivity]:
        """Count one request of `sequences` choices for adapter `model_adapter` (as the request
        names it, `name` or `name@version`; None for the base model) from now until the block
        ends, starting in the GATEWAY phase."""
        adapter = adapter_name(model_adapter) if model_adapter is not None else None
        request = RequestActivity(self, adapter, sequences)
        try:
            yield request
        finally:
            request.leave()

    def adapters(self, phase: Phase) -> set[str]:
        """Adapter names (no version) with at least one request in `phase`."""
        return set(self._adapters[phase])

    def sequences(self, phase: Phase) -> int:
        """Sequences (a request's `n` choices each) in `phase`: vLLM counts each choice as one
        request."""
        return self._sequences[phase]
