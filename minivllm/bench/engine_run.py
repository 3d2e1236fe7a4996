"""Run a workload through minivllm's ``LLMEngine`` and time every output token.

All requests arrive at once (offline throughput, as vLLM's ``benchmark_throughput.py``); the engine is stepped
until it is empty. A token's timestamp is the end of the step that sampled it, which is when a streaming client
would see it. The same driver can hold requests back to play static batching (see ``run_engine``).
"""

from __future__ import annotations

import time
from typing import List, Optional

from tqdm.auto import tqdm

from minivllm.bench.metrics import PeakMemory, RunResult, result_from_timestamps
from minivllm.bench.workload import Workload
from minivllm.engine.llm_engine import LLMEngine


def run_engine(engine: LLMEngine, workload: Workload, progress: bool = True, desc: Optional[str] = None,
               batch_size: Optional[int] = None) -> RunResult:
    """Step ``engine`` through every request of ``workload``, all of which arrive at time 0.

    With ``batch_size=None`` every request is added at once and the engine batches continuously. With a
    ``batch_size``, the client plays *static batching*: it hands over ``batch_size`` requests, waits until all of
    them have finished, then hands over the next ones (``batch_size=1`` is serving one request at a time). Time
    spent waiting for an earlier batch counts in a request's time to first token, as it would for a user.

    Args:
        engine: an idle engine.
        workload: the requests (greedy, ``ignore_eos``).
        progress: show a tqdm bar of finished requests.
        desc: the bar's label.
        batch_size: ``None`` (continuous batching) or the static batch size (>= 1).

    Returns:
        A ``RunResult`` with ``token_ids`` in workload order.

    Raises:
        ValueError: if the engine has unfinished requests, ``batch_size < 1``, or a request is rejected.
    """
    if engine.has_unfinished_requests():
        raise ValueError(f"engine must be idle, it has {engine.get_num_unfinished_requests()} unfinished requests")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    n = workload.num_requests
    batches = [list(range(n))] if batch_size is None else [list(range(i, min(i + batch_size, n)))
                                                           for i in range(0, n, batch_size)]
    params = workload.sampling_params()
    preempt0 = engine.num_preemptions
    steps0 = engine.scheduler.stats.num_steps
    times: List[List[float]] = [[] for _ in range(workload.num_requests)]
    tokens: List[List[int]] = [[] for _ in range(workload.num_requests)]
    bar = tqdm(total=workload.num_requests, desc=desc or f"minivllm {workload.name}", disable=not progress,
               unit="req", dynamic_ncols=True)
    with PeakMemory(engine.device) as mem:
        start = time.perf_counter()
        for batch in batches:
            index = {}
            for i in batch:
                index[engine.add_request(None, {"prompt_token_ids": workload.prompts[i]}, params[i])] = i
            while engine.has_unfinished_requests():
                outputs = engine.step()
                now = time.perf_counter()
                for o in outputs:
                    i = index[o.request_id]
                    for t in o.new_token_ids:
                        times[i].append(now)
                        tokens[i].append(t)
                    if o.finished:
                        bar.update(1)
        end = time.perf_counter()
    bar.close()
    config = {
        "dtype": str(engine.dtype).replace("torch.", ""),
        "device": str(engine.device),
        "max_num_batched_tokens": engine.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": engine.scheduler_config.max_num_seqs,
        "enable_chunked_prefill": engine.scheduler_config.enable_chunked_prefill,
        "enable_prefix_caching": engine.cache_config.enable_prefix_caching,
        "block_size": engine.cache_config.block_size,
        "num_gpu_blocks": engine.cache_config.num_gpu_blocks,
        "batching": "continuous" if batch_size is None else f"static({batch_size})",
    }
    return result_from_timestamps(
        "minivllm", workload, times, start, end, token_ids=tokens,
        peak_mem_mib=mem.peak_mib,
        num_preemptions=engine.num_preemptions - preempt0,
        num_steps=engine.scheduler.stats.num_steps - steps0,
        config=config,
    )
