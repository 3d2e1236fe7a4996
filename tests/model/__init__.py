"""Tests of ``minivllm/model``: the Llama model, its loaders, CustomOp dispatch; greedy tokens equal transformers'."""
