"""Where the time of one engine step goes: the PyTorch profiler's per-operator times, grouped into what a reader
recognises (linear layers, the KV gather, the rest of attention, ...), plus what no operator accounts for: the
Python of the scheduler, the model runner and the model, and PyTorch's dispatch (vLLM profiles the same way with
``VLLM_TORCH_PROFILER_DIR``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Tuple

from minivllm.i18n import N_, _, is_chinese

# First matching rule wins (``bmm`` before ``mm``). The labels are English keys; ``profile_step`` returns them in
# the current language (notebook 09 prints and plots ``by_category`` as it is).
CATEGORIES: List[Tuple[str, Tuple[str, ...]]] = [
    (N_("attention: KV gather"), ("index_select",)),
    (N_("attention: QK^T, softmax, PV"), ("bmm", "softmax", "masked_fill", "scaled_dot_product", "paged_attention")),
    (N_("linear layers + LM head"), ("_linear_pointwise", "aten::mm", "aten::addmm", "packed_gemm", "skinny_gemm")),
    (N_("KV cache write"), ("index_copy",)),
    (N_("sampling"), ("argmax", "exponential", "topk", "sort")),
]
OTHER = N_("other tensor ops (norms, RoPE, SiLU, copies)")
OVERHEAD = N_("Python + dispatch (no operator running)")


def categorise(op_name: str) -> str:
    """The category of a profiler operator name such as ``aten::bmm``."""
    for label, keys in CATEGORIES:
        if any(k in op_name for k in keys):
            return label
    return OTHER


@dataclass
class StepProfile:
    """One profiled step.

    Attributes:
        wall_s: the step's wall time, seconds.
        by_category: seconds per category (``OVERHEAD`` is wall time minus all operators' self time), keyed by
            the category's label in the current language (``CATEGORIES``' English labels by default).
        top_ops: ``(operator, calls, seconds)``, largest first.
    """

    wall_s: float
    by_category: Dict[str, float]
    top_ops: List[Tuple[str, int, float]]


def profile_step(engine) -> StepProfile:
    """Run ``engine.step()`` once under ``torch.profiler`` (CPU activities) and group the operators' self times.

    Self times only count an operator's own work, so nested calls (``aten::linear`` calling a matmul) are not
    counted twice. With one thread, operator self time is close to wall time, so the remainder of the step's wall
    time is time spent outside any operator. The profiler adds a few microseconds per operator, so the overhead
    shown is an upper bound.

    Raises:
        ValueError: if the engine has nothing to do.
    """
    from torch.profiler import ProfilerActivity, profile

    if not engine.has_unfinished_requests():
        raise ValueError("engine has no request to step")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
    cats: Dict[str, float] = {label: 0.0 for label, _keys in CATEGORIES}
    cats[OTHER] = 0.0
    ops = []
    for e in prof.key_averages():
        sec = e.self_cpu_time_total / 1e6
        if sec <= 0:
            continue
        cats[categorise(e.key)] += sec
        ops.append((e.key, e.count, sec))
    cats[OVERHEAD] = max(wall - sum(cats.values()), 0.0)
    ops.sort(key=lambda o: -o[2])
    if is_chinese():
        # The notebook plots these labels with pandas on axes it makes itself: the CJK font must be in
        # rcParams before it does, or the Chinese labels draw as empty boxes.
        from minivllm.course.viz.fonts import use_language_font

        use_language_font()
    return StepProfile(wall, {_(k): v for k, v in cats.items()}, ops[:12])
