"""minivllm: a small vLLM-style inference engine for teaching (V1 scheduler, paged KV cache, chunked prefill,
preemption, prefix caching), running a real Llama-architecture model on CPU or CUDA."""

from minivllm.engine.llm import LLM
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
