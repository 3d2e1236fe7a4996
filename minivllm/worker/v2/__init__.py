"""Model Runner V2 (vLLM 0.32: ``vllm/v1/worker/gpu/``; its CPU twin ``vllm/v1/worker/cpu/model_runner.py``)."""
