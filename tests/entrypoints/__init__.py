"""Tests of ``minivllm/entrypoints``: the OpenAI-compatible server and ``AsyncLLM`` behind it (vLLM:
``tests/entrypoints/``)."""
