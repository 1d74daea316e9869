"""The HTTP gateway: OpenAI-compatible API over vLLM's async engine."""
