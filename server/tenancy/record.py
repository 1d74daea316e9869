"""What is observed of one request, filled in as it goes and read once at the end.

The access-log middleware creates the record when the request arrives; authentication sets the
tenant, the route sets the adapter, the engine stream reports tokens as they come. At the end the
same record feeds the access log line and the metrics, so the two always agree.
All times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    request_id: str
    method: str
    path: str
    started: float
    tenant: str | None = None
    model: str | None = None
    adapter: str | None = None
    status: int = 0
    error_type: str | None = None
    queued_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Set when the request is handed to the engine: only then were its prompt tokens processed,
    # so only then do they count against the tenant's quota and in the token metrics.
    reached_engine: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    # (time, tokens) of every engine output that carried tokens, per choice: TPOT and inter-token
    # latency are a sequence's, and a request with n > 1 streams n sequences at once.
    chunks: dict[int, list[tuple[float, int]]] = field(default_factory=dict, repr=False)

    def on_tokens(self, count: int, now: float, choice: int = 0) -> None:
        if count <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.completion_tokens += count
        self.chunks.setdefault(choice, []).append((now, count))

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT definition), of each
        sequence, averaged over the request's sequences."""
        per_sequence = [
            (chunks[-1][0] - chunks[0][0]) / (tokens - 1)
            for chunks in self.chunks.values()
            if (tokens := sum(n for _, n in chunks)) >= 2
        ]
        return statistics.fmean(per_sequence) if per_sequence else None

    @property
    def output_tokens_per_s(self) -> float | None:
        """Output tokens over the time from arrival to the last token (what a client sees)."""
        if self.last_token_at is None or self.last_token_at <= self.started:
            return None
        return self.completion_tokens / (self.last_token_at - self.started)

    def inter_token_latencies(self) -> list[float]:
        """One gap per token after a sequence's first; a chunk of n tokens spreads its gap
        over n."""
        gaps: list[float] = []
        for chunks in self.chunks.values():
            for (prev, _), (now, count) in itertools.pairwise(chunks):
                gaps.extend([(now - prev) / count] * count)
        return gaps

    @property
    def processed_tokens(self) -> int:
        """Tokens the engine processed: prompt and output, nothing if it never saw the request
        (refused, failed before the engine, client gone while queued)."""
        return self.prompt_tokens + self.completion_tokens if self.reached_engine else 0
