"""Tests of ``minivllm/core`` (vLLM: ``tests/v1/core/``): scheduler, KV cache manager, block pool, the scheduler's side
of the KV connector; driven alone (``test_scheduler*.py``, ``test_async_scheduler.py``) or through the tiny engine."""
