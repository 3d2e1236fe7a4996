"""The building blocks of the model (vLLM: ``vllm/model_executor/layers/``), one concept per module."""
