"""Streaming clients in a process of their own, timing every token they receive.

Inter-token latency measured in the test process itself is not the server's: that process also
runs the test's own threads, whose turns at the GIL delay the client's reads, so tokens are seen
late and in bursts. And in one CI run a cold request sent from a thread of the test process
reached the server at least 50 s after it was sent, when the measurement had already given up.
So the one request whose timing the test is about, the cold one, is sent from here too, and
every time in the report is taken here.

Protocol (stdin/stdout, one line each). It prints `decoding` once every stream has received
`--warm-tokens` tokens. On a line `cold MODEL` it sends one streamed request for MODEL and notes
when it was sent and when its first token came. On `stop` it waits up to `--cold-timeout` s for
that first token, stops the streams and prints one JSON object: `streams`, each stream's token
arrival times, `decoding`, when it printed `decoding`, and `cold`: `sent`, `first_token` and
`error`. All in `time.monotonic()` seconds, one clock for all processes.

    python -m tests.support.stream_clock --base-url URL --model a --model b --max-tokens 1500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionChunk


def _carries_token(chunk: ChatCompletionChunk) -> bool:
    # Tokens are timed by their logprobs, not their text: a token that ends mid-character (the
    # first bytes of a multi-byte character) has no text yet and is sent with the next one, which
    # would read as a stalled step.
    choice = chunk.choices[0] if chunk.choices else None
    return bool(choice and choice.logprobs and choice.logprobs.content)


async def _stream(client: AsyncOpenAI, model: str, max_tokens: int, times: list[float]) -> None:
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=max_tokens, temperature=0, stream=True, logprobs=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if _carries_token(chunk):
            times.append(time.monotonic())


async def _cold_first_token(client: AsyncOpenAI, model: str, cold: dict[str, Any]) -> None:
    cold["sent"] = time.monotonic()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            stream=True, logprobs=True,
        )  # fmt: skip
        async for chunk in stream:
            if _carries_token(chunk):
                cold["first_token"] = time.monotonic()
                await stream.close()
                return
        cold["error"] = "the stream ended with no token"
    except Exception as e:  # reported to the test, which fails on it
        cold["error"] = repr(e)


async def _main(args: argparse.Namespace) -> None:
    client = AsyncOpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key, max_retries=0)
    times: list[list[float]] = [[] for _ in args.model]
    tasks = [
        asyncio.create_task(_stream(client, m, args.max_tokens, times[i]))
        for i, m in enumerate(args.model)
    ]
    while min(len(t) for t in times) < args.warm_tokens:
        if any(t.done() for t in tasks):
            break  # a stream ended or failed early: report it below rather than wait forever
        await asyncio.sleep(0.02)
    decoding = time.monotonic()
    print("decoding", flush=True)
    cold: dict[str, Any] = {"sent": None, "first_token": None, "error": None}
    cold_task: asyncio.Task[None] | None = None
    while (line := (await asyncio.to_thread(sys.stdin.readline)).split()) and line[0] != "stop":
        if line[0] == "cold" and cold_task is None:
            cold_task = asyncio.create_task(_cold_first_token(client, line[1], cold))
    if cold_task is not None:
        try:
            await asyncio.wait_for(cold_task, args.cold_timeout)
        except TimeoutError:
            cold["error"] = f"no first token in {args.cold_timeout} s"
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task  # a stream that failed raises here and the parent sees no JSON
    await client.close()
    print(json.dumps({"streams": times, "decoding": decoding, "cold": cold}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--warm-tokens", type=int, default=5)
    parser.add_argument("--cold-timeout", type=float, default=120.0)
    parser.add_argument("--api-key", default="none", help="the streams' tenant key")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
