"""Rotary position embedding and its cached factory (vLLM: ``vllm/model_executor/layers/rotary_embedding/``:
``RotaryEmbedding`` in ``base.py``, ``get_rope`` in ``__init__.py``)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from minivllm import custom_ops
from minivllm.model.custom_op import CustomOp, no_kernel_for


class RotaryEmbedding(CustomOp):
    """Rotary position embedding, half-split ("NeoX") style as in Hugging Face Llama (Su et al. 2021).

    ``cos_cache`` and ``sin_cache`` (``float32 [max_position, head_dim]``, on the CPU) hold the angles of every
    position, so a token's rotation depends only on its absolute position: a prefill chunk needs nothing from
    earlier chunks to rotate its q/k. Both are full width so one rotation is ``x * cos + rotate_half(x) * sin``
    (as in Hugging Face's ``apply_rotary_pos_emb``); ``sin_cache`` carries the minus sign of ``rotate_half`` in
    its first half. vLLM keeps one ``[max_position, rotary_dim]`` cos|sin buffer of half-width tables instead.

    The tables are plain attributes, not buffers: ``model.to(bfloat16)`` must not round the angles, and one
    instance is shared by every attention layer (``get_rope``), possibly of several models on several devices,
    so a copy per device is made on first use instead of moving the tables. Being shared, its dispatch
    (``CustomOp``) is the last model runner's choice; that never changes a number, since the kernel is
    bit-identical to ``forward_native`` in bfloat16 and in float32 (``tests/worker/test_custom_ops.py``). For the same
    reason ``forward_cpu`` gives the kernel either dtype whatever ``kernel_dtype`` the last runner set: a float32
    model under ``MINIVLLM_CPU_KERNELS_FP32=1`` must not take the kernel away from a bfloat16 model that shares
    this instance, and a float32 model on the reference (``MINIVLLM_CPU_KERNELS_FP32=0``) gets the reference's
    exact bits from it.
    """

    def __init__(self, head_size: int, max_position: int, base: float) -> None:
        super().__init__()
        # device="cpu" explicitly: a model built under ``torch.device("meta")`` still gets real tables.
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float64, device="cpu") / head_size))
        t = torch.arange(max_position, dtype=torch.float64, device="cpu")
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos().float(), freqs.sin().float()
        self.head_size = head_size
        self.max_position = max_position
        self.base = base
        self.cos_cache = torch.cat((cos, cos), dim=-1)
        self.sin_cache = torch.cat((-sin, sin), dim=-1)
        self._tables: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    def _angles(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        # Gathered per layer, as vLLM's ``forward_native`` does: [T, 1, head_size] each, broadcast over heads.
        dev = positions.device
        if dev not in self._tables:
            self._tables[dev] = (self.cos_cache.to(dev), self.sin_cache.to(dev))
        cos, sin = self._tables[dev]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor] = None):
        """Rotate ``query [T, H, D]`` and ``key [T, Hkv, D]`` (or ``None``) by the angles of ``positions [T]``;
        returns new tensors ``(query, key)``, same dtype. q and k heads may come stacked as one ``query``.

        vLLM's ``forward`` takes the flat ``[T, H * D]`` q and k; here they come with their head dimension.
        """
        cos, sin = self._angles(positions)
        return _rotate(query, cos, sin), None if key is None else _rotate(key, cos, sin)

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor] = None):
        """In bfloat16 or float32, the q|k heads of the fused qkv output stacked in ``query [T, H + Hkv, D]``
        (``key=None``, heads contiguous) are rotated in place by one kernel (``custom_ops.rotary_embedding``,
        bit-identical in both dtypes, so ``kernel_dtype`` is not consulted: see the class doc) and ``(query, None)``
        returned; anything else takes ``forward_native``."""
        if (key is not None or query.dtype not in _KERNEL_DTYPES or no_kernel_for(query, query.dtype)
                or query.dim() != 3 or query.stride(2) != 1 or query.stride(1) != query.shape[2]):
            return self.forward_native(positions, query, key)
        custom_ops.rotary_embedding(positions, query, query.shape[1], self.cos_cache, self.sin_cache)
        return query, None


_KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # custom_ops.rotary_embedding is bit-identical in both


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Bit-identical to cat(x1*cos - x2*sin, x2*cos + x1*sin) in float32: x2*(-sin) == -(x2*sin) exactly.
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)


_ROPE_DICT: Dict[Tuple, RotaryEmbedding] = {}


def get_rope(head_size: int, max_position: int, base: float, is_neox_style: bool = True) -> RotaryEmbedding:
    """The ``RotaryEmbedding`` for these parameters, built once per process and shared by every caller.

    Every attention layer asks for its RoPE here, so the 30 layers of a model (and equal models) share one
    ``[max_position, head_size]`` pair of tables (vLLM's ``get_rope`` keeps the same ``_ROPE_DICT`` cache).

    Args:
        head_size: dimensions per head that are rotated (all of them: no partial rotary factor here).
        max_position: positions ``0 .. max_position - 1`` have angles.
        base: ``rope_theta``.
        is_neox_style: half-split pairs (``i`` with ``i + head_size / 2``), as Hugging Face Llama; the
            interleaved GPT-J style (``False``) is not implemented.

    Raises:
        ValueError: for ``is_neox_style=False``, an odd ``head_size`` or a non-positive size.
    """
    if not is_neox_style:
        raise ValueError("get_rope: is_neox_style=False (interleaved GPT-J pairs) is not implemented")
    if head_size < 2 or head_size % 2 or max_position < 1:
        raise ValueError(f"get_rope: head_size must be even and >= 2 and max_position >= 1, got {head_size}, "
                         f"{max_position}")
    key = (head_size, max_position, float(base), is_neox_style)
    if key not in _ROPE_DICT:
        _ROPE_DICT[key] = RotaryEmbedding(head_size, max_position, base)
    return _ROPE_DICT[key]
