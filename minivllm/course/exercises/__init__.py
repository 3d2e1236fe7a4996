"""Checkers for the course's "Your turn" exercises.

Each ``check_x(fn)`` runs reference tests against a learner's function. When every test passes it prints
``✓ x: all N tests passed``. When ``fn`` is still a stub (raises ``NotImplementedError``) it says so and returns.
Otherwise it raises ``ExerciseFailed`` saying which input failed, what was expected, what came back, and, when the
wrong answer matches a known mistake, how to fix it. Expected values come from the ``minivllm`` package itself.

Notebook 01 (a Llama layer from parts, generation without a cache):
    ``check_rms_norm``, ``check_rope``, ``check_gqa_attention``, ``check_swiglu``, ``check_decoder_layer``,
    ``check_greedy_generate``; ``split_layer_weights`` slices a fused layer into separate matrices.
Notebook 02 (a contiguous KV cache): ``check_kv_cache``, ``check_cached_attention``.
Notebook 03 (paged KV blocks): ``check_slot_mapping``, ``check_write_kv``, ``check_gather_kv``,
    ``check_paged_attention``; ``one_request_metadata`` builds the attention metadata of a one-request batch.
Notebook 04 (static versus continuous batching): ``check_static_batching``.
Notebook 05 (chunked prefill): ``check_predict_chunks``; ``check_chunk_prediction`` (a budget shared by a decode,
    a resumed request and a new one; ``show_shared_budget`` prints the state it starts from).
Notebook 06 (preemption): none here; its exercises are engine parts (``minivllm.course.learner.lesson06``).
Notebook 07 (prefix caching): none here; its exercise is an engine part (``minivllm.course.learner.lesson07``).
Notebook 08 (KV connectors): its exercise is an engine part, checked by ``minivllm.course.learner.lesson08``.
The worked solutions are out of the main flow: 01-02 in ``notebooks/solutions/01_02_foundations_solutions.ipynb``,
each of 03-08 in its own notebook there. The cells of 01-03 that build on an exercise take
``use_yours_or_reference(yours, fallback.name, check_x)``: the learner's function when it passes its checker, else
the package's own (``minivllm.course.exercises.fallback``).
"""

from minivllm.course.exercises import fallback
from minivllm.course.exercises._harness import ExerciseFailed, use_yours_or_reference
from minivllm.course.exercises._reference import one_request_metadata, split_layer_weights
from minivllm.course.exercises.batching import check_static_batching
from minivllm.course.exercises.chunks import check_chunk_prediction, check_predict_chunks, show_shared_budget
from minivllm.course.exercises.generation import check_greedy_generate
from minivllm.course.exercises.kv_cache import check_cached_attention, check_kv_cache
from minivllm.course.exercises.layers import (
    check_decoder_layer,
    check_gqa_attention,
    check_rms_norm,
    check_rope,
    check_swiglu,
)
from minivllm.course.exercises.paged import check_gather_kv, check_paged_attention, check_slot_mapping, check_write_kv

__all__ = [
    "ExerciseFailed",
    "check_cached_attention",
    "check_chunk_prediction",
    "check_decoder_layer",
    "check_gather_kv",
    "check_gqa_attention",
    "check_greedy_generate",
    "check_kv_cache",
    "check_paged_attention",
    "check_predict_chunks",
    "check_rms_norm",
    "check_rope",
    "check_slot_mapping",
    "check_static_batching",
    "check_swiglu",
    "check_write_kv",
    "fallback",
    "one_request_metadata",
    "show_shared_budget",
    "split_layer_weights",
    "use_yours_or_reference",
]
