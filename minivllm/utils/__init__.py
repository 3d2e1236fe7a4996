"""Small helpers with no dependencies (vLLM: ``vllm/utils/``). The lowest layer: imports nothing of minivllm."""
