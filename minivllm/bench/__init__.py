"""Benchmarks: minivllm against real peers on one seeded workload, in one run (``python -m minivllm bench``).

* ``workload``: the seeded request mixes (random prompts, a shared system prompt, the batch-1 latency case).
* ``engine_run``: drives an ``LLMEngine`` step by step and times every token (TTFT, inter-token latency).
* ``hf_peer``: the same workload through Hugging Face transformers' batched ``generate`` (same weights).
* ``vllm_peer``: vLLM's CPU build in a subprocess, only where ``vllm`` is importable.
* ``metrics`` / ``report``: the numbers of one run, the table and the JSON file.
* ``cli``: the command line.

What each engine optimisation gained is written down in ``OPTIMISATIONS.md`` next to this file.
"""

from minivllm.bench.metrics import RunResult
from minivllm.bench.workload import Workload, latency_workload, random_workload, shared_prefix_workload

__all__ = ["RunResult", "Workload", "random_workload", "shared_prefix_workload", "latency_workload"]
