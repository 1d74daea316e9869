"""vLLM's chat server with whole logprobs responses built off the event loop (issue 45).

For a whole chat response that asks for logprobs, vLLM's `chat_completion_full_generator` builds
every token's entries in one synchronous pass after the last output (`_create_chat_logprobs`:
86k pydantic objects for n=16 x 256 tokens x top_logprobs=20), which held the gateway's loop
1.1 s at once and stalled every other tenant's stream (docs/stalls.md). Here the engine's
outputs are still read on the loop (a client that leaves cancels that read, and its engine
requests are aborted as before), then vLLM's own generator builds the response from them in a
worker thread, in an event loop of its own: the build competes for the GIL only at the switch
interval instead of holding the loop. What it touches there is the request's own: its outputs,
parsers vLLM makes per request and per choice, and the tokenizer's decode (the fallback for a
token the engine did not detokenize), which the Rust backend serves from any thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat


async def _replay(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


class OffLoopLogprobsChat(OpenAIServingChat):
    async def chat_completion_full_generator(
        self, request: Any, result_generator: AsyncIterator[Any], *args: Any, **kwargs: Any
    ) -> Any:
        build = super().chat_completion_full_generator
        if not request.logprobs:
            return await build(request, result_generator, *args, **kwargs)
        outputs = [output async for output in result_generator]
        return await asyncio.to_thread(
            asyncio.run, build(request, _replay(outputs), *args, **kwargs)
        )
