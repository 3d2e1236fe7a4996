"""Time the three kinds of engine step that make up a serving run: ``python -m minivllm.bench.step_times``.

* a prefill step of 2048 tokens (the first steps of the benchmark workload: whole prompts and chunks);
* a decode step of 64 requests with 100-300-token contexts (the middle of the workload);
* a batch-1 decode step with a 160-token context (the latency case).

Each is the median of several steps, in wall seconds and in CPU seconds of this process. On a shared machine the
CPU time is the steadier of the two (another process cannot inflate it much); with one thread it is close to the
wall time of a quiet machine. This is how ``OPTIMISATIONS.md`` measured each engine change.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _timed(engine) -> tuple:
    c, t = time.process_time(), time.perf_counter()
    engine.step()
    return time.perf_counter() - t, time.process_time() - c


def measure_step_times(model=None, dtype: str = "bfloat16", decode_steps: int = 12, batch1_steps: int = 30) -> Dict:
    """``{"prefill_2048": (wall_s, cpu_s), "decode_64": ..., "batch1": ...}`` medians for the default model
    (or ``model``, a ``LlamaForCausalLM``), prefix caching off."""
    import torch

    from minivllm import LLMEngine, SamplingParams
    from minivllm.bench.workload import latency_workload, random_workload

    eng = LLMEngine(model, dtype=dtype, enable_prefix_caching=False)
    wl = random_workload(64, vocab_size=eng.vocab_size)
    long_run = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for p in wl.prompts:
        eng.add_request(None, {"prompt_token_ids": p}, long_run)
    prefill: List[tuple] = []
    while True:
        w = _timed(eng)
        li = eng.model_runner.last_inputs
        if li.input_ids.numel() == eng.scheduler_config.max_num_batched_tokens:
            prefill.append(w)
        if li.input_ids.numel() == len(li.req_ids) == wl.num_requests:
            break
    decode = [_timed(eng) for _ in range(decode_steps)]
    eng.abort_request(list(eng.scheduler.requests))
    eng.add_request(None, {"prompt_token_ids": latency_workload(vocab_size=eng.vocab_size).prompts[0]}, long_run)
    for _ in range(3):
        eng.step()
    one = [_timed(eng) for _ in range(batch1_steps)]

    def med(xs):
        return (statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs))

    return {"prefill_2048": med(prefill), "decode_64": med(decode), "batch1": med(one),
            "threads": torch.get_num_threads(), "loadavg": os.getloadavg()[0]}


def main(argv: Optional[List[str]] = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m minivllm.bench.step_times", description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(a.threads)
    os.environ["MINIVLLM_CPU_THREADS_AUTO"] = "0"  # the count asked for, for every step measured
    r = measure_step_times(dtype=a.dtype)
    for k in ("prefill_2048", "decode_64", "batch1"):
        print(f"{k:13s} wall {r[k][0] * 1e3:8.1f} ms   cpu {r[k][1] * 1e3:8.1f} ms")
    print(f"threads {r['threads']}, load average {r['loadavg']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
