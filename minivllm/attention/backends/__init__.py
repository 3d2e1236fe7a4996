"""Attention backends, one module each (vLLM: ``vllm/v1/attention/backends/``).

* ``reference``: ``REFERENCE``, one request at a time, explicit gather and mask; the one to read.
* ``torch_sdpa``: ``TORCH_SDPA``, decode requests in batched matmuls, prefill chunks through PyTorch SDPA.
* ``cpu_attn``: ``CPU_ATTN``, minivllm's C++ kernels (``minivllm.custom_ops``), bfloat16 on the CPU.

``minivllm.attention.selector.get_attn_backend`` chooses one per model runner.
"""
