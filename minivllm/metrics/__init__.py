"""Counters the engine keeps about itself (vLLM: ``vllm/v1/metrics/``). A leaf: imports nothing of minivllm."""
