"""The numbers of one benchmark run, computed from per-token timestamps (vLLM ``benchmarks/benchmark_serving.py``
reports the same ones: throughput, TTFT, ITL percentiles).

* time to first token (TTFT): from the request's arrival (all arrive at the start) to its first output token;
* inter-token latency (ITL): the gaps between consecutive output tokens of a request, pooled over requests;
* output tokens/s: output tokens of all requests / wall time of the run; total tokens/s adds the prompt tokens.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np


@dataclass
class RunResult:
    """One system on one workload, one run.

    Attributes:
        system: ``"minivllm"``, ``"transformers"`` or ``"vllm"``.
        workload: the workload's name.
        num_requests, prompt_tokens, output_tokens: what was done (output tokens actually produced per request,
            capped at each request's ``max_tokens``).
        elapsed_s: wall time from the first request's arrival to the last token, seconds.
        output_tok_s / total_tok_s: throughput, tokens per second.
        ttft_p50_s / ttft_p99_s: time to first token percentiles, seconds.
        itl_p50_s / itl_p99_s: inter-token latency percentiles, seconds.
        decode_tok_s: for a single request, ``(output_tokens - 1) / (last token - first token)``.
        peak_mem_mib: peak resident memory of the process during the run (CPU) or peak allocated (CUDA), MiB.
        num_preemptions: preemptions during the run (minivllm; 0 for engines without them).
        num_steps: forward passes.
        config: the knobs of the run (dtype, threads, batch size, prefix caching, ...).
        token_ids: each request's output tokens (kept for equality checks, left out of the JSON).
    """

    system: str
    workload: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_p50_s: Optional[float] = None
    ttft_p99_s: Optional[float] = None
    itl_p50_s: Optional[float] = None
    itl_p99_s: Optional[float] = None
    decode_tok_s: Optional[float] = None
    peak_mem_mib: Optional[float] = None
    num_preemptions: int = 0
    num_steps: Optional[int] = None
    config: Dict = field(default_factory=dict)
    token_ids: Optional[List[List[int]]] = field(default=None, repr=False)

    def to_json(self) -> Dict:
        d = asdict(self)
        d.pop("token_ids")
        return d


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """``q``-th percentile (0..100, linear interpolation as ``numpy.percentile``), ``None`` for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def result_from_timestamps(
    system: str,
    workload,
    token_times: List[List[float]],
    start: float,
    end: float,
    token_ids: Optional[List[List[int]]] = None,
    **extra,
) -> RunResult:
    """Build a ``RunResult`` from ``token_times[i]`` (``time.perf_counter()`` of each output token of request
    ``i``, in order) and the run's ``start`` and ``end`` times.

    Raises:
        ValueError: if ``end < start`` or a request has no token.
    """
    if end < start:
        raise ValueError(f"end ({end}) is before start ({start})")
    if any(len(t) == 0 for t in token_times):
        raise ValueError("every request must have produced at least one token")
    elapsed = end - start
    n_out = sum(len(t) for t in token_times)
    ttft = [t[0] - start for t in token_times]
    itl = [b - a for t in token_times for a, b in zip(t, t[1:])]
    decode = None
    if len(token_times) == 1 and len(token_times[0]) > 1:
        t = token_times[0]
        decode = (len(t) - 1) / max(t[-1] - t[0], 1e-12)
    return RunResult(
        system=system,
        workload=workload.name,
        num_requests=workload.num_requests,
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=n_out,
        elapsed_s=elapsed,
        output_tok_s=n_out / max(elapsed, 1e-12),
        total_tok_s=(n_out + workload.num_prompt_tokens) / max(elapsed, 1e-12),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(itl, 50),
        itl_p99_s=percentile(itl, 99),
        decode_tok_s=decode,
        token_ids=token_ids,
        **extra,
    )


class PeakMemory:
    """Peak memory of a code block, MiB.

    On CUDA: ``torch.cuda.max_memory_allocated`` (reset at the start). On Linux CPU: the process's resident-set
    high-water mark ``VmHWM``, reset at the start by writing ``5`` to ``/proc/self/clear_refs``; where that is not
    allowed, the high-water mark since the process started (``ru_maxrss``), so it can only overstate.
    """

    def __init__(self, device=None) -> None:
        self.cuda = device is not None and str(device).startswith("cuda")
        self.peak_mib: Optional[float] = None

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM, so the peak is this run's, not the process's
            except OSError:
                pass  # not Linux, or not allowed: the peak then counts from the process's start
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.peak_mib = torch.cuda.max_memory_allocated() / 2**20
            return
        self.peak_mib = _vm_hwm_mib()


def _vm_hwm_mib() -> float:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass  # no /proc: getrusage's lifetime maximum below
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def median_run(runs: Sequence[RunResult]) -> RunResult:
    """The run with the median output tokens/s (the lower middle one for an even count)."""
    if not runs:
        raise ValueError("no runs")
    ordered = sorted(runs, key=lambda r: r.output_tok_s)
    return ordered[(len(ordered) - 1) // 2]
