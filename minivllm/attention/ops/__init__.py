"""Triton kernels of the attention backends (vLLM: ``vllm/v1/attention/ops/`` at v0.32.0).

* ``triton_reshape_and_cache_flash``: write this step's keys and values into the paged KV cache by slot mapping.
* ``triton_unified_attention``: paged attention of a mixed batch (prefill chunks and decodes) read through the
  block table in place, with an online softmax; long decodes split over the context and reduced.
* ``triton_utils``: are the kernels interpreted (``TRITON_INTERPRET=1``), the shared input checks.
* ``compile_check``: compile every kernel variant for a GPU architecture on a machine without a GPU.

Nothing here is imported by ``minivllm.attention`` itself: importing this package does not need Triton, the two
kernel modules do (``import triton`` at module level).
"""
