"""The engine the learner builds: their parts, plugged into the real engine through vLLM's own seams.

* ``parts``: the registry of parts (what each lesson's learner writes, its checker and hints) and ``check``, the
  call a notebook makes after an exercise cell;
* ``compare``: a learner's ``scheduler_cls`` against the reference ``Scheduler``, step by step, on workloads in
  the live vLLM check's format, with the first difference named;
* ``cells`` and ``grade``: the grader (``./course.sh grade``), which reads the exercise cells from the saved
  notebooks;
* ``lesson03`` ... ``lesson08``: each lesson's parts and checkers.

The engine never imports this package; it only receives what the learner wrote, as ``scheduler_cls``,
``attention_backend`` or ``kv_connector``.
"""

from minivllm.course.learner.parts import NotWritten, Part, PartFailed, check

__all__ = ["NotWritten", "Part", "PartFailed", "check"]
