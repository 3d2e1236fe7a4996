"""Attention backends, one module each (vLLM: ``vllm/v1/attention/backends/``).

* ``reference``: ``REFERENCE``, one request at a time, explicit gather and mask; the one to read.
* ``torch_sdpa``: ``TORCH_SDPA``, decode requests in batched matmuls, prefill chunks through PyTorch SDPA.
* ``cpu_attn``: ``CPU_ATTN``, minivllm's C++ kernels (``minivllm.custom_ops``), bfloat16 on the CPU.
* ``triton_attn``: ``TRITON_ATTN``, the Triton kernels of ``minivllm.attention.ops`` (KV write, unified paged
  attention); the default on CUDA, on the CPU only under ``TRITON_INTERPRET=1``.

``minivllm.attention.selector.get_attn_backend`` chooses one per model runner.
"""
