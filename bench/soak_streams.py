"""The soak's bystanders: steady greedy streams in a process of their own (for bench.soak).

Timed here, not in the soak's process, for the reason bench.stall_clock gives: that process
builds 8 MiB bodies and drives the churn, and its turns at the GIL would read as inter-token
gaps. Each stream is one tenant asking one model (the base model or its own adapter) the same
chat question with `max_tokens` greedy tokens and `ignore_eos`, again and again, until `stop`
arrives on stdin. A request that fails is recorded and the stream goes on after a short pause.

It prints `decoding` once every stream has its first token (or a line saying which failed, and
exits), and on `stop` one JSON object:
`requests`, one per request sent, each {stream, status, error, text, tokens: [[time, count]]}
(`time.monotonic()` seconds of each chunk that carried tokens, and how many), in order of
sending. A request still open at `stop` is cancelled and left out.

    python -m bench.soak_streams --base-url URL --max-tokens 256 --stream KEY MODEL ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx

from bench.streams_process import decode_until_stop

# Different questions per stream, so no stream's prompt is another's cached prefix.
QUESTIONS = (
    "Tell me a long story about a lighthouse keeper.",
    "Describe, step by step, how bread is baked.",
    "Write a long letter to a friend about the sea.",
    "Explain in detail how a river shapes its valley.",
)
RETRY_PAUSE_S = 0.5
START_TIMEOUT_S = 300.0


async def _one_request(
    client: httpx.AsyncClient, key: str, body: dict[str, Any], record: dict[str, Any]
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        record["status"] = r.status_code
        if r.status_code != 200:
            record["error"] = (await r.aread())[:300].decode(errors="replace")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:  # an error after the first byte: the stream's last event
                record["error"] = json.dumps(event["error"])[:300]
                return
            for choice in event.get("choices") or []:
                # Timed by logprobs, not text: a token that ends mid-character has no text yet.
                count = len((choice.get("logprobs") or {}).get("content") or [])
                if count:
                    record["tokens"].append([time.monotonic(), count])
                record["text"] += choice.get("delta", {}).get("content") or ""


async def _stream_forever(
    client: httpx.AsyncClient, index: int, key: str, model: str, max_tokens: int,
    requests: list[dict[str, Any]],
) -> None:  # fmt: skip
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "logprobs": True,
        "ignore_eos": True,
    }
    while True:
        record: dict[str, Any] = {"stream": index, "status": 0, "error": None, "text": "",
                                  "tokens": []}  # fmt: skip
        requests.append(record)
        try:
            await _one_request(client, key, body, record)
        except httpx.HTTPError as e:
            record["error"] = f"{type(e).__name__}: {e}"[:300]
        record["done"] = True
        if record["error"] is not None:
            await asyncio.sleep(RETRY_PAUSE_S)


async def _main(args: argparse.Namespace) -> None:
    requests: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(600.0)) as client:
        tasks = [
            asyncio.create_task(_stream_forever(client, i, key, model, args.max_tokens, requests))
            for i, (key, model) in enumerate(args.stream)
        ]
        started: set[int] = set()
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(started) < len(tasks) and time.monotonic() < deadline:
            started = {r["stream"] for r in requests if r["tokens"]}
            await asyncio.sleep(0.05)
        if len(started) < len(tasks):
            print(f"not decoding after {START_TIMEOUT_S} s: {requests[-4:]}", flush=True)
            return
        await decode_until_stop(tasks)
    # The requests cancelled at `stop` (one per stream) have no outcome.
    finished = [r for r in requests if r.pop("done", False)]
    print(json.dumps({"requests": finished}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--stream", nargs=2, action="append", metavar=("KEY", "MODEL"), required=True,
        help="one steady stream: a tenant's API key and the model it asks (repeatable)",
    )  # fmt: skip
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
