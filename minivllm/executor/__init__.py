"""Executors: how the engine core runs the model on one or more workers (vLLM: ``vllm/v1/executor/``).

``abstract.Executor`` is the interface the engine core uses; ``UniProcExecutor`` runs one device in this process,
``ExecutorWithExternalLauncher`` one rank of a ``torchrun`` job in this process, and ``MultiprocExecutor`` one
worker process per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Type

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.executor.abstract import Executor


def get_executor_class(vllm_config: "VllmConfig") -> Type["Executor"]:
    """The executor class of ``parallel_config.distributed_executor_backend`` (vLLM ``Executor.get_class``; a
    function here so that ``abstract.py`` does not import its own subclasses).

    Raises:
        ValueError: for an unknown backend.
    """
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from minivllm.executor.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor
    from minivllm.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor
    if backend == "external_launcher":
        return ExecutorWithExternalLauncher
    if backend in (None, "uni"):
        return UniProcExecutor
    raise ValueError(f"unknown distributed_executor_backend {backend!r}")
