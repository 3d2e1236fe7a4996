"""Notebook 12's instruments: each rank's share of a model, and one step's time split into compute and
communication on every rank.

The timers run inside the worker processes: ``MultiprocExecutor.collective_rpc(install_step_timer)`` wraps the
worker's ``execute_model`` and ``sample_tokens`` (one step) and ``torch.distributed``'s ``all_reduce`` / ``all_gather`` (which the parallel layers
call through ``minivllm.distributed.communication_op``) with ``time.perf_counter`` accumulators;
``collective_rpc(read_step_timer)`` returns and resets them. Communication time on a rank includes the time it
waits for the slowest rank to reach the collective.
"""

from __future__ import annotations

import time
from typing import Dict, List

import torch
import torch.distributed as dist

from minivllm.distributed import parallel_state

_TIMES: Dict[str, float] = {}


def _timed(name: str, fn, count: bool = True):
    """``fn`` adding its time to ``name_s`` and, when ``count``, one to ``name_calls``."""
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _TIMES[name + "_s"] = _TIMES.get(name + "_s", 0.0) + time.perf_counter() - t
            if count:
                _TIMES[name + "_calls"] = _TIMES.get(name + "_calls", 0) + 1
    wrapper.minivllm_timed = True  # not __wrapped__: torch's decorators (functools.wraps) already set that
    return wrapper


def install_step_timer(worker_or_runner) -> None:
    """Time every step and every collective of this process from now on (a ``Worker`` in a worker process, or
    the ``ModelRunner`` of a single-device engine: then there are no collectives)."""
    if not getattr(worker_or_runner.execute_model, "minivllm_timed", False):
        # A step is execute_model (the forward pass, counted) and then sample_tokens (its time only).
        worker_or_runner.execute_model = _timed("step", worker_or_runner.execute_model)
        worker_or_runner.sample_tokens = _timed("step", worker_or_runner.sample_tokens, count=False)
    for name in ("all_reduce", "all_gather"):
        if not getattr(getattr(dist, name), "minivllm_timed", False):
            setattr(dist, name, _timed(name, getattr(dist, name)))
    _TIMES.clear()


def read_step_timer(worker_or_runner=None) -> Dict[str, float]:
    """The totals since the last read (seconds and call counts), then reset."""
    out = {k: _TIMES.get(k, 0) for k in ("step_s", "step_calls", "all_reduce_s", "all_reduce_calls",
                                         "all_gather_s", "all_gather_calls")}
    _TIMES.clear()
    return out


def rank_shares(hf_config, world_size: int) -> List[Dict[str, object]]:
    """Each rank's parameters, built on the meta device (no memory) as that rank: one row per (rank, parameter)
    with its shape, its element count, and whether every rank holds the same tensor (replicated)."""
    from minivllm.model.llama import LlamaForCausalLM

    rows = []
    for rank in range(world_size):
        with parallel_state.build_as_rank(rank, world_size), torch.device("meta"):
            model = LlamaForCausalLM(hf_config)
        for name, p in model.named_parameters():
            rows.append({"rank": rank, "parameter": name, "shape": tuple(p.shape), "elements": p.numel()})
    return rows


def rank_layer_model(hf_config, rank: int, world_size: int):
    """The model as ``rank`` of ``world_size`` builds it, on the meta device (shapes and shard ranges only)."""
    from minivllm.model.llama import LlamaForCausalLM

    with parallel_state.build_as_rank(rank, world_size), torch.device("meta"):
        return LlamaForCausalLM(hf_config)


__all__ = ["install_step_timer", "rank_kv_cache", "rank_layer_model", "rank_shares", "read_step_timer"]


def rank_kv_cache(worker, layer: int = 0) -> torch.Tensor:
    """A copy of this rank's KV cache of ``layer``, ``[2, num_blocks + 1, block_size, kv_heads_per_rank,
    head_dim]`` (for ``collective_rpc``: functions defined in a notebook cannot be sent to a worker process)."""
    return worker.model_runner.kv_caches[layer].clone()
