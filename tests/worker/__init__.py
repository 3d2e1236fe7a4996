"""Tests of ``minivllm/worker``, ``attention``, ``custom_ops.py`` and ``csrc``: model runners, block table, sampler,
attention backends, kernels (vLLM: ``tests/v1/worker/``, ``tests/kernels/``)."""
