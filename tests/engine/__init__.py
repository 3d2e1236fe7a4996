"""Tests of ``minivllm/engine`` and the one-process executor below it: ``LLM``, ``LLMEngine``, ``EngineCore`` end to
end, the KV connector through the engine (vLLM: ``tests/v1/engine/``)."""
