"""The OpenAI-compatible HTTP server (vLLM: ``vllm/entrypoints/openai/``); start it with ``python -m minivllm serve``."""
