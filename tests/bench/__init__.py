"""Tests of ``minivllm/bench``: the benchmarks, the GPU check, the live vLLM check."""
