"""Executors: how the engine runs the model on one or more ranks (vLLM: ``vllm/v1/executor/``).

With ``tensor_parallel_size=1`` there is no executor: the engine core calls its ``ModelRunner`` directly
(``EngineCore`` says why). With more ranks, ``MultiprocExecutor`` spawns one worker process per rank, and
``ExecutorWithExternalLauncher`` runs one rank in each process that ``torchrun`` started.
"""
