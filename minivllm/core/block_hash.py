"""The block-hash type, in a leaf module of its own (vLLM keeps ``BlockHash`` in ``vllm/v1/core/kv_cache_utils.py``).

minivllm differs from vLLM here on purpose: ``request.py`` needs the type and ``kv_cache_utils.py`` needs
``Request``, so with the type in ``kv_cache_utils`` the two modules would import each other. This module imports
nothing, which ends that cycle. ``kv_cache_utils`` imports ``BlockHash`` from here, so
``from minivllm.core.kv_cache_utils import BlockHash`` (vLLM's spelling) still works.
"""

BlockHash = bytes
"""A block's prefix hash: a 32-byte SHA-256 digest. Stable across processes, so a disk store can use it."""
