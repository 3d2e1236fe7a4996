"""Tests of the engine core (vLLM: ``tests/v1/core/``): scheduler, KV cache manager, block pool, driven alone."""
