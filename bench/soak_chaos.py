"""What the soak's third tenant (mallory) does beside the bystanders' streams (for bench.soak).

- `churn`: her adapters registered, used, deleted while a request on them streams, and
  registered again (the other demo adapter's bytes each time, so each registration is a new
  version with a new engine id), more of them than the engine's CPU cache holds;
- `disconnects`: requests abandoned by their client: streams dropped after a few tokens or
  before the first, whole requests given up by a client timeout;
- `oversized`: chat prompts just under `http.max_body_bytes` sent one after another for a phase
  (issue 45, finding 3: one stalled every stream 11.4 s);
- `poison`: an adapter registered with good bytes whose weights in the server's disk cache are
  then rewritten as NaN (same header, same size: the cache serves them), as values that slipped
  past the registration check would reach the engine; its requests are expected to fail 422
  `adapter_quarantined` and the adapter to be quarantined.

Every outcome is counted in a `Tally` by what sent it and how it ended: an HTTP status, a code
from an error event inside a 200 stream (`200:<code>`), `abandoned` (the client left on
purpose) or `0:<exception>` (no answer).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WEIGHTS = "adapter_model.safetensors"


@dataclass
class Tally:
    outcomes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    def add(self, what: str, outcome: str | int) -> None:
        self.outcomes[what][str(outcome)] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {what: dict(sorted(c.items())) for what, c in sorted(self.outcomes.items())}


@dataclass
class Window:
    """One injected phase: when it ran (monotonic seconds) and what its requests got."""

    kind: str  # `oversized` or `poison`
    start: float
    end: float = 0.0
    replies: Counter[str] = field(default_factory=Counter)
    note: dict[str, Any] = field(default_factory=dict)


@dataclass
class Mallory:
    base_url: str
    key: str
    admin_token: str
    model: str  # the base model's name
    tally: Tally = field(default_factory=Tally)

    def client(self, **kw: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.key}"}
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, **kw)

    def admin(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=300)

    # ---- streams and their outcomes ----

    async def _stream(
        self, client: httpx.AsyncClient, body: dict[str, Any], first_token: asyncio.Event | None
    ) -> str:
        """A streamed request's outcome; sets `first_token` when its first chunk arrives (or
        when it ends without one)."""
        try:
            async with client.stream("POST", "/v1/chat/completions", json={**body,
                                     "stream": True}) as r:  # fmt: skip
                if r.status_code != 200:
                    await r.aread()
                    return str(r.status_code)
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if first_token is not None:
                        first_token.set()
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        return f"200:{event['error'].get('code')}"
                return "200"
        except httpx.HTTPError as e:
            return f"0:{type(e).__name__}"
        finally:
            if first_token is not None:
                first_token.set()

    def _chat(self, model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        question = [{"role": "user", "content": "Name three cities by a river."}]
        return {"model": model, "messages": question, "max_tokens": max_tokens,
                "temperature": 0, **extra}  # fmt: skip

    # ---- churn ----

    async def churn(self, names: list[str], sources: list[Path], stop: asyncio.Event) -> None:
        """Each name in turn: delete it while a request on it streams (the delete waits for
        it), register it again from the next source, ask it twice (streamed and whole)."""
        registered: set[str] = set()
        source = itertools.cycle(sources)
        async with self.admin() as admin, self.client(timeout=300) as client:
            for name in itertools.cycle(names):
                if stop.is_set():
                    return
                if name in registered:
                    first = asyncio.Event()
                    streaming = asyncio.create_task(
                        self._stream(client, self._chat(name, 48), first)
                    )
                    await first.wait()
                    deleted = await admin.delete(f"/admin/v1/adapters/{name}")
                    self.tally.add("churn_delete", deleted.status_code)
                    self.tally.add("churn_request_during_delete", await streaming)
                    registered.discard(name)
                body = {"name": name, "source": str(next(source))}
                r = await admin.post("/admin/v1/adapters", json=body)
                self.tally.add("churn_register", r.status_code)
                if r.status_code != 201:
                    continue
                registered.add(name)
                self.tally.add("churn_request", await self._stream(client, self._chat(name, 16),
                                                                    None))  # fmt: skip
                whole = await client.post("/v1/chat/completions", json=self._chat(name, 8))
                self.tally.add("churn_request", whole.status_code)

    async def remove(self, names: list[str]) -> list[str]:
        """Delete those of `names` still registered; the names deleted."""
        deleted = []
        async with self.admin() as admin:
            for name in names:
                if (await admin.delete(f"/admin/v1/adapters/{name}")).status_code == 200:
                    deleted.append(name)
        return deleted

    # ---- disconnects ----

    async def disconnects(self, interval_s: float, stop: asyncio.Event, seed: int) -> None:
        """One abandoned request every `interval_s`, of three kinds in turn, each left with
        the engine still working on it."""
        rng = random.Random(seed)
        body = self._chat(self.model, 200, ignore_eos=True)
        kinds = itertools.cycle(("after_tokens", "before_first_token", "whole_timeout"))
        pending: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            task = asyncio.create_task(self._abandon(next(kinds), body, rng.randint(1, 8)))
            pending.add(task)
            task.add_done_callback(pending.discard)
            await asyncio.sleep(interval_s)
        await asyncio.gather(*pending)

    async def _abandon(self, kind: str, body: dict[str, Any], tokens: int) -> None:
        what = f"disconnect_{kind}"
        if kind == "whole_timeout":
            async with self.client(timeout=0.5) as client:
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                    self.tally.add(what, r.status_code)
                except httpx.TimeoutException:
                    self.tally.add(what, "abandoned")
                except httpx.HTTPError as e:
                    self.tally.add(what, f"0:{type(e).__name__}")
            return
        async with self.client(timeout=300) as client:
            try:
                async with client.stream("POST", "/v1/chat/completions",
                                         json={**body, "stream": True}) as r:  # fmt: skip
                    if r.status_code != 200:
                        await r.aread()
                        self.tally.add(what, r.status_code)
                        return
                    if kind == "after_tokens":
                        chunks = 0
                        async for line in r.aiter_lines():
                            chunks += line.startswith("data: {")
                            if chunks >= tokens:
                                break
                    self.tally.add(what, "abandoned")  # leaving the block closes the stream
            except httpx.HTTPError as e:
                self.tally.add(what, f"0:{type(e).__name__}")

    # ---- injections ----

    async def oversized(self, body: bytes, phase_s: float) -> Window:
        """Maximal chat prompts, one after another, for `phase_s` seconds."""
        window = Window("oversized", time.monotonic())
        headers = {"content-type": "application/json"}
        async with self.client(timeout=300) as client:
            while time.monotonic() - window.start < phase_s:
                try:
                    r = await client.post("/v1/chat/completions", content=body, headers=headers)
                    outcome = str(r.status_code)
                    if r.status_code == 400:
                        outcome += f":{r.json()['error'].get('code')}"
                except httpx.HTTPError as e:
                    outcome = f"0:{type(e).__name__}"
                window.replies[outcome] += 1
                self.tally.add("oversized", outcome)
                await asyncio.sleep(0.2)
        window.end = time.monotonic()
        return window

    async def poison(self, name: str, source: Path, cache_dir: Path) -> Window:
        """Register `source` as `name`, rewrite its cached weights as NaN, send three requests
        at once (whole, streamed, with logprobs), read its health, then delete it."""
        window = Window("poison", time.monotonic())
        async with self.admin() as admin, self.client(timeout=300) as client:
            r = await admin.post("/admin/v1/adapters", json={"name": name,
                                                            "source": str(source)})  # fmt: skip
            self.tally.add("poison_register", r.status_code)
            if r.status_code == 201:
                version = r.json()["version"]
                cached = cache_dir / "adapters" / "disk" / "versions" / version / WEIGHTS
                await asyncio.to_thread(rewrite_as_nan, cached)

                async def whole(**extra: Any) -> str:
                    reply = await client.post("/v1/chat/completions",
                                              json=self._chat(name, 12, **extra))  # fmt: skip
                    code = reply.json().get("error", {}).get("code") if reply.is_error else None
                    return f"{reply.status_code}:{code}" if code else str(reply.status_code)

                outcomes = await asyncio.gather(
                    whole(),
                    self._stream(client, self._chat(name, 12, temperature=1.0), None),
                    whole(logprobs=True, top_logprobs=2),
                )
                for outcome in outcomes:
                    window.replies[outcome] += 1
                    self.tally.add("poison_request", outcome)
                info = (await admin.get(f"/admin/v1/adapters/{name}")).json()
                window.note = {"health": info.get("health"),
                               "quarantine_reason": info.get("quarantine_reason")}  # fmt: skip
                deleted = await admin.delete(f"/admin/v1/adapters/{name}")
                self.tally.add("poison_delete", deleted.status_code)
        window.end = time.monotonic()
        return window


def rewrite_as_nan(weights: Path) -> None:
    """Every value of the safetensors file `weights` set to NaN, in place: same header, same
    size."""
    import torch
    from safetensors.torch import load_file, save_file

    size = weights.stat().st_size
    tensors = load_file(weights)
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, weights)
    if weights.stat().st_size != size:
        raise RuntimeError(f"{weights}: the NaN copy changed its size")


def scaled_copy(demo: Path, factor: float, dest: Path) -> Path:
    """The adapter folder `demo` with every lora_B scaled by `factor`: good values, bytes (and
    so a version) of its own."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "adapter_config.json").write_bytes((demo / "adapter_config.json").read_bytes())
    tensors = load_file(demo / WEIGHTS)
    save_file({k: v * factor if "lora_B" in k else v for k, v in tensors.items()}, dest / WEIGHTS)
    return dest
