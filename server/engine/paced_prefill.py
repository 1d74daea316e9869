"""A vLLM scheduler that paces a backlogged tenant's prefills while other tenants are served.

The fair dispatcher (tenancy.fair) stamps each request with an engine priority: 0 when its tenant's
requests all fit its share (or the tenant is alone), above 0 when the tenant is backlogged beside
others. A priority-0 request is *light*; any other is *paced*.

vLLM cannot preempt a step once it runs, so a light request that arrives while a step is carrying
a flooding tenant's whole prefill waits that step out, and its own first step may carry another
such prefill. On the CPU fairness bench a 64-token prefill made a step of about 280 ms against
about 100 ms for the decodes alone. This scheduler keeps those steps short:

- paced prompts prefill `paced_prefill_tokens` per step, one paced request at a time (the
  oldest): on that bench a 16-token chunk adds about 45 ms to a step;
- while a light request still has prompt to prefill, the step carries the light prompts, whole,
  and the light requests' decodes: paced requests sit that step out, so it costs what it would
  with the light tenants alone (the flood's decodes lose one step per light request).

With only light requests (one tenant, or tenancy.engine_priority off) it schedules exactly as
vLLM's scheduler does (tests/server/test_paced_prefill.py checks step by step).

Everything else is vLLM's scheduler. It sets three things of vLLM's `Scheduler` per call (the
chunk threshold in its config, `max_num_scheduled_tokens` and a request's
`next_decode_eligible_step`), so `supported()` checks for them and the engine builder falls back to
vLLM's own scheduler, with a log line, on a vLLM without them. The chunk size comes in as the
config's `long_prefill_token_threshold` (engine.paced_prefill_tokens, set by the builder); since
every call sets that threshold for itself, vLLM never applies it as configured.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

# What vLLM's `Scheduler.schedule` must read for the pacing to take effect (vLLM 0.32 does).
KNOBS = ("long_prefill_token_threshold", "max_num_scheduled_tokens", "next_decode_eligible_step")


def supported() -> bool:
    """Whether this vLLM's `schedule` reads every knob the pacing turns."""
    import inspect

    source = inspect.getsource(Scheduler.schedule)
    return all(name in source for name in KNOBS)


def _prefill_left(request: Any) -> int:
    """Prompt tokens still to prefill (0 for a request that is decoding)."""
    return max(0, int(request.num_tokens) - int(request.num_computed_tokens) - 1)


class PacedPrefillScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paced_prefill_tokens = self.scheduler_config.long_prefill_token_threshold
        self._full_budget = self.max_num_scheduled_tokens

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        light = [r for r in self.waiting if r.priority == 0]
        light += [r for r in self.running if r.priority == 0 and _prefill_left(r) > 0]
        paced = [r for r in self.running if r.priority > 0]
        if light:
            # The light prompts, whole, and the light requests' decodes: every paced request sits
            # this step out, so the step costs what it would with the light tenants alone.
            sit_out = paced
            threshold = 0
            decodes = sum(1 for r in self.running if r.priority == 0 and _prefill_left(r) == 0)
            budget = decodes + sum(_prefill_left(r) + 1 for r in light)
        else:
            # Every decode and one paced chunk: the oldest paced prefill goes on, or else the
            # first waiting one starts.
            prefilling = [r for r in paced if _prefill_left(r) > 0]
            sit_out = sorted(prefilling, key=lambda r: (r.priority, r.arrival_time))[1:]
            threshold = self.paced_prefill_tokens
            decodes = sum(1 for r in self.running if _prefill_left(r) == 0)
            budget = decodes + self.paced_prefill_tokens
        for request in sit_out:
            # vLLM skips a running request until this step (schedule() counts it up first).
            request.next_decode_eligible_step = self.current_step + 2
        self.scheduler_config.long_prefill_token_threshold = threshold
        self.max_num_scheduled_tokens = min(self._full_budget, budget)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.scheduler_config.long_prefill_token_threshold = self.paced_prefill_tokens
            self.max_num_scheduled_tokens = self._full_budget
