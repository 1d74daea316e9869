"""Streaming clients in a process of their own, timing every token they receive.

Inter-token latency measured in the test process itself is not the server's: that process also
runs moto's S3 server and the fault proxy, whose threads take the GIL and delay the client's reads,
so tokens are seen late and in bursts. This process does nothing but read the streams.

Protocol (stdin/stdout, one line each): it prints `decoding` once every stream has received
`--warm-tokens` tokens; it stops the streams when a line arrives on stdin, then prints one JSON
line: each stream's token arrival times in `time.monotonic()` seconds (one clock for all processes).

    python -m tests.support.stream_clock --base-url URL --model a --model b --max-tokens 1500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time

from openai import AsyncOpenAI


async def _stream(client: AsyncOpenAI, model: str, max_tokens: int, times: list[float]) -> None:
    # Tokens are timed by their logprobs, not their text: a token that ends mid-character (the
    # first bytes of a multi-byte character) has no text yet and is sent with the next one, which
    # would read as a stalled step.
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=max_tokens, temperature=0, stream=True, logprobs=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice and choice.logprobs and choice.logprobs.content:
            times.append(time.monotonic())


async def _main(args: argparse.Namespace) -> None:
    client = AsyncOpenAI(base_url=f"{args.base_url}/v1", api_key="none", max_retries=0)
    times: list[list[float]] = [[] for _ in args.model]
    tasks = [
        asyncio.create_task(_stream(client, m, args.max_tokens, times[i]))
        for i, m in enumerate(args.model)
    ]
    while min(len(t) for t in times) < args.warm_tokens:
        if any(t.done() for t in tasks):
            break  # a stream ended or failed early: report it below rather than wait forever
        await asyncio.sleep(0.02)
    print("decoding", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task  # a stream that failed raises here and the parent sees no JSON
    await client.close()
    print(json.dumps(times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--warm-tokens", type=int, default=5)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
