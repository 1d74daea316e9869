"""Steady streams in a process of their own, timing every token they receive (for bench.stall).

Inter-token latency timed inside the benchmark's own process would include that process's turns
at the GIL (it builds and sends 8 MiB bodies), so the streams run here. Each of `--streams`
chat streams asks the base model for `--max-tokens` tokens with `ignore_eos`, and starts again
when it ends, until `stop` arrives on stdin. It prints `decoding` once every stream has its first
token, and on `stop` one JSON object: `requests`, a list of token arrival lists, one per stream
request, and `probes`, [sent, seconds] of a GET /health every `--probe-interval` seconds (the
event loop answers it at once: its latency is the loop's stall, apart from the engine's speed),
in `time.monotonic()` seconds (one clock for all processes).

    python -m bench.stall_clock --base-url URL --model M --streams 4 --max-tokens 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx

from bench.streams_process import decode_until_stop


def _carries_token(line: str) -> bool:
    """An SSE chunk with a token: timed by its logprobs, not its text (a token that ends
    mid-character has no text yet and would read as a stalled step)."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool((choices[0].get("logprobs") or {}).get("content"))


async def _stream_forever(
    client: httpx.AsyncClient, args: argparse.Namespace, requests: list[list[float]]
) -> None:
    body: dict[str, Any] = {
        "model": args.model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "logprobs": True,
        "ignore_eos": True,
    }
    while True:
        times: list[float] = []
        requests.append(times)
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if _carries_token(line):
                    times.append(time.monotonic())


async def _probe_forever(
    client: httpx.AsyncClient, interval: float, probes: list[tuple[float, float]]
) -> None:
    while True:
        sent = time.monotonic()
        (await client.get("/health")).raise_for_status()
        probes.append((sent, time.monotonic() - sent))
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - sent)))


async def _main(args: argparse.Namespace) -> None:
    requests: list[list[float]] = []
    probes: list[tuple[float, float]] = []
    timeout = httpx.Timeout(600.0)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=timeout, headers=headers
    ) as client:
        tasks = [
            asyncio.create_task(_stream_forever(client, args, requests))
            for _ in range(args.streams)
        ]
        tasks.append(asyncio.create_task(_probe_forever(client, args.probe_interval, probes)))
        while len(requests) < args.streams or any(not r for r in requests):
            if any(t.done() for t in tasks):
                break  # a stream failed: report it below rather than wait forever
            await asyncio.sleep(0.02)
        await decode_until_stop(tasks)
    print(json.dumps({"requests": requests, "probes": probes}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--probe-interval", type=float, default=0.05)
    parser.add_argument("--api-key", default=None, help="the steady streams' tenant's key")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
