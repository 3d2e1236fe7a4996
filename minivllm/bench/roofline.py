"""The roofline of this machine and where an engine step sits on it (Williams, Waterman & Patterson, "Roofline: an
insightful visual performance model", CACM 2009).

A step can go no faster than its arithmetic allows (``FLOPs / peak FLOP/s``) nor faster than its memory traffic
allows (``bytes / bandwidth``). With arithmetic intensity ``I = FLOPs / bytes``, the attainable rate is
``min(peak, I * bandwidth)``. A batch-1 decode step reads every weight to do 2 FLOPs per weight (``I`` about 1 for
bfloat16): it sits on the sloped, memory-bound part. A step of 64 decodes does 64 times the arithmetic on the same
weights and moves towards the flat, compute-bound part. Both roofs are measured here, on this machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from minivllm.model.llama import LlamaConfig
from minivllm.model.packed_linear import PackedWeight


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (kernel selection, first-touch of memory)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def measure_peak_flops(dtype: torch.dtype = torch.bfloat16, m: int = 1024, k: int = 576, n: int = 1536,
                       repeats: int = 5) -> float:
    """FLOP/s of a large ``[m, k] x [k, n]`` matmul, the way the engine multiplies (packed weights for bf16).

    The shape is one of the model's own (hidden 576, intermediate 1536), so the roof is what this model's
    layers can reach on this machine, not a vendor figure. Median of ``repeats`` runs.
    """
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    pw = PackedWeight()
    with torch.inference_mode():
        sec = _median_seconds(lambda: pw.linear(x, w), repeats)
    return 2.0 * m * k * n / sec


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: copy a ``mib`` MiB buffer (far larger than the caches) into another and count
    bytes read plus bytes written. Median of ``repeats`` runs."""
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    sec = _median_seconds(lambda: dst.copy_(src), repeats)
    return 2.0 * n * 4 / sec


@dataclass
class StepCost:
    """Arithmetic and memory traffic of one forward step.

    Attributes:
        flops: floating-point operations (a multiply-add counts 2).
        bytes: bytes that must come from memory at least once: every weight the step uses, the KV cache it reads
            and writes.
    """

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes


def step_cost(config: LlamaConfig, dtype: torch.dtype, context_lens: Sequence[int], query_lens: Sequence[int]) -> StepCost:
    """FLOPs and bytes of one step of a Llama model.

    Args:
        config: the model.
        dtype: weight and KV-cache dtype.
        context_lens: per request, tokens already in the KV cache before the step.
        query_lens: per request, tokens computed in the step (1 for a decode). Each request gets logits for its
            last token only (``logits_indices``).

    Returns:
        ``StepCost``. Linear layers: ``2 x params x tokens``; LM head: ``2 x hidden x vocab`` per request;
        attention: ``4 x heads x head_dim`` per (query, key) pair (QK^T and PV); norms and activations are left out
        (a few FLOPs per element).
    """
    c = config
    es = torch.finfo(dtype).bits // 8
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    linear_params = c.num_hidden_layers * per_layer
    head_params = c.hidden_size * c.vocab_size
    tokens = sum(query_lens)
    pairs = sum(qn * ctx + qn * (qn + 1) // 2 for ctx, qn in zip(context_lens, query_lens))
    flops = (2.0 * linear_params * tokens + 2.0 * head_params * len(query_lens)
             + 4.0 * c.num_attention_heads * c.head_dim * pairs * c.num_hidden_layers)
    kv_per_token = c.kv_bytes_per_token(dtype)
    kv_bytes = kv_per_token * (sum(context_lens) + 2 * tokens)  # read the context, write and read the new tokens
    return StepCost(flops, (linear_params + head_params) * es + kv_bytes)


def plot_roofline(ax, peak_flops: float, bandwidth: float, points=(), xlim=(0.1, 1000.0)):
    """Draw the roofline (GFLOP/s against FLOPs per byte, log-log) and ``points``: ``(label, StepCost, seconds)``
    with the rate each step reached. Returns ``ax``. The roofline's own labels are in the current language (the
    points' labels are the caller's)."""
    import numpy as np

    from minivllm.course.viz.fonts import use_language_font
    from minivllm.i18n import _

    use_language_font(ax)

    x = np.logspace(np.log10(xlim[0]), np.log10(xlim[1]), 200)
    ax.loglog(x, np.minimum(peak_flops, x * bandwidth) / 1e9, color="black", lw=2, label=_("roofline (measured)"))
    ridge = peak_flops / bandwidth
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    ax.annotate(_("ridge: {ridge} FLOP/byte").format(ridge=f"{ridge:.0f}"), (ridge, peak_flops / 1e9 / 30), rotation=90, fontsize=8,
                ha="right", color="grey")
    for label, cost, seconds in points:
        ax.loglog([cost.intensity], [cost.flops / seconds / 1e9], "o", ms=8, label=label)
    ax.set_xlabel(_("arithmetic intensity (FLOPs per byte from memory)"))
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)
    return ax
