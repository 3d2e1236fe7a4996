"""Entry points above the engine (vLLM: ``vllm/entrypoints/``): the OpenAI-compatible server."""
