"""Who this process is in the tensor-parallel group (vLLM: ``vllm/distributed/parallel_state.py``).

vLLM keeps one ``GroupCoordinator`` per kind of parallelism (tensor, pipeline, data, expert); minivllm has only
tensor parallelism, so the state is this module's: the ``torch.distributed`` process group of the ranks that
share one model, this process's rank in it and the group's size. A process that never calls
``initialize_model_parallel`` is a group of one (rank 0 of 1): every parallel layer is then the plain layer it
replaces, and no collective is called.

The layers read the group *when they are built* (as vLLM's do): a model built after
``initialize_model_parallel(2)`` holds one rank's share of each weight.

Where minivllm differs from vLLM 0.32: on the CPU the world is gloo with one worker thread (``GLOO_ONE_WORKER``),
and leaving it first drains that thread (``drain_gloo_worker``), because with torch 2.13 a process that exits
while gloo's thread still holds a collective's tensor can abort. vLLM's `init_distributed_environment
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/distributed/parallel_state.py#L1814>`_ and
`destroy_distributed_environment
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/distributed/parallel_state.py#L2506>`_ use torch's gloo as
it is; its CPU build's tensor-parallel collectives go through its own shared-memory kernels when the ranks share a
machine (`_CPUSHMDistributed
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/distributed/device_communicators/cpu_communicator.py#L228>`_),
not through gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import weakref
from typing import Iterator, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_TP_GROUP: Optional[dist.ProcessGroup] = None
_TP_RANK = 0
_TP_SIZE = 1


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str = "env://",
                                 backend: Optional[str] = None, local_rank: int = 0) -> None:
    """Join the ``torch.distributed`` world (``dist.init_process_group``) unless this process already has.

    Args:
        world_size / rank: this process's place among all processes.
        distributed_init_method: a rendezvous URL (``"tcp://host:port"``), or ``"env://"`` under ``torchrun``
            (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` from the environment).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors); ``None`` picks NCCL when CUDA is
            available, else gloo, as vLLM's platform does. ``"gloo"`` is gloo with one worker thread
            (``GLOO_ONE_WORKER``; why: ``drain_gloo_worker``).
        local_rank: the CUDA device of this process on its machine (ignored on the CPU).
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    elif backend == "gloo":
        backend = _register_gloo_one_worker()
    dist.init_process_group(backend, init_method=distributed_init_method, world_size=world_size, rank=rank)


GLOO_ONE_WORKER = "minivllm_gloo"
"""The name under which ``torch.distributed`` knows gloo with one worker thread (torch's gloo has two, and
``init_process_group`` takes no gloo options). minivllm's collectives are synchronous, one at a time, so two
threads never run at the same time; with one, the thread finishes each collective, lets go of it, and only then
takes the next, which ``drain_gloo_worker`` relies on."""


def _new_gloo_one_worker(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
                         ) -> "dist.ProcessGroupGloo":
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    # The interfaces torch's own gloo would pick: GLOO_SOCKET_IFNAME's (comma-separated), else the host name's.
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    options._devices = ([ProcessGroupGloo.create_device(interface=n) for n in names] if names
                        else [ProcessGroupGloo.create_default_device()])
    options._threads = 1
    return ProcessGroupGloo(store, rank, size, options)


def _register_gloo_one_worker() -> str:
    if GLOO_ONE_WORKER not in dist.Backend.backend_list:
        # devices=["cpu"] names what it can run; torch's default backend for "cpu" (init_process_group without a
        # backend) stays plain gloo. Groups made from this world with new_group() inherit it.
        dist.Backend.register_backend(GLOO_ONE_WORKER, _new_gloo_one_worker, devices=["cpu"])
    return GLOO_ONE_WORKER


def initialize_model_parallel(tensor_model_parallel_size: int) -> None:
    """Make the whole ``torch.distributed`` world one tensor-parallel group of ``tensor_model_parallel_size``
    ranks (minivllm has no pipeline or data parallelism to carve out of it).

    Raises:
        RuntimeError: if ``init_distributed_environment`` was not called, or the world's size differs.
    """
    global _TP_GROUP, _TP_RANK, _TP_SIZE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel: call init_distributed_environment first")
    if dist.get_world_size() != tensor_model_parallel_size:
        raise RuntimeError(f"tensor_parallel_size ({tensor_model_parallel_size}) must equal the torch.distributed "
                           f"world size ({dist.get_world_size()}): minivllm has no other parallelism")
    _TP_GROUP = dist.group.WORLD
    _TP_RANK, _TP_SIZE = dist.get_rank(), tensor_model_parallel_size


def destroy_model_parallel(release_timeout_s: float = 10.0) -> None:
    """Leave the group and the ``torch.distributed`` world (a worker's last step).

    On gloo it first lets gloo's worker thread finish with every tensor the collectives gave it
    (``drain_gloo_worker``; ``release_timeout_s`` bounds the wait for the release, while the drain's two
    collectives wait for the other ranks as any collective does), so that a process that exits right after does
    not abort.
    """
    global _TP_GROUP, _TP_RANK, _TP_SIZE
    _TP_GROUP, _TP_RANK, _TP_SIZE = None, 0, 1
    if dist.is_initialized():
        if dist.get_backend() == GLOO_ONE_WORKER and not drain_gloo_worker(release_timeout_s):
            logger.warning("gloo's worker thread may still hold a tensor (a rank gone, or %.0f s passed): the "
                           "process can abort at exit", release_timeout_s)
        dist.destroy_process_group()


def drain_gloo_worker(timeout_s: float = 10.0) -> bool:
    """Return once gloo's worker thread holds no tensor that has a Python object, every rank having got here;
    ``False`` when a peer is gone or ``timeout_s`` passed first.

    Why: a collective's work object holds its tensors, and gloo's worker thread may drop its reference after the
    caller's ``wait()`` has returned. Under torch 2.13's PyObject preservation, dropping a reference to a tensor
    that has a Python object takes the GIL. If the main thread is finalizing the interpreter by then, the worker
    thread is ended inside a ``noexcept`` C++ frame and the process aborts ("terminate called without an active
    exception", SIGABRT, after every token was out: torch issue #190489; an ``atexit`` fix, pytorch PR #179291,
    was abandoned). ``destroy_process_group`` does not stop gloo's threads, and a barrier alone does not help:
    gloo's barrier keeps weak references to the works still queued or running when it was called, which keep
    their tensors until the barrier itself is dropped, on the worker thread.

    How, with one worker thread (``GLOO_ONE_WORKER``), which drops each work, holding gloo's work lock, before it
    takes the next:

    1. an all-reduce of a tensor only this function holds, with a ``weakref.finalize`` on it: it fires when the
       tensor is freed, which is after every earlier work was dropped, and either while the worker drops this
       one (lock held) or, if the worker let go first, when this function does;
    2. then a barrier: it takes that lock to list the works in progress, so it waits for the worker to finish
       dropping, finds none, and holds no tensor of Python's. It is the last work; dropping it takes no GIL.

    The event alone is not enough (8 aborts in 100 stress runs without step 2): the finalizer runs on the worker
    thread in the middle of freeing the tensor, and torch frees it with the GIL let go, so the worker still needs
    the GIL back after the event is set, and the main thread can be finalizing by then.
    """
    released = threading.Event()
    sentinel = torch.zeros(1)
    weakref.finalize(sentinel, released.set)
    try:
        dist.all_reduce(sentinel)
    except RuntimeError:
        # A peer already gone (gloo raises at once on a closed connection); the failed work still holds the
        # sentinel, so let the worker drop it before leaving.
        del sentinel
        released.wait(timeout_s)
        return False
    del sentinel
    if not released.wait(timeout_s):
        return False
    try:
        dist.barrier()
    except RuntimeError:
        return False
    return True


def model_parallel_is_initialized() -> bool:
    return _TP_GROUP is not None


def get_tp_group() -> Optional[dist.ProcessGroup]:
    """The tensor-parallel process group, or ``None`` in a group of one."""
    return _TP_GROUP


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in the tensor-parallel group (0 when there is none)."""
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    """Ranks in the tensor-parallel group (1 when there is none)."""
    return _TP_SIZE


@contextlib.contextmanager
def build_as_rank(rank: int, world_size: int) -> Iterator[None]:
    """Build layers as rank ``rank`` of ``world_size`` while inside, without a process group: the loader builds
    the whole model as ``build_as_rank(0, 1)`` (``full_model_view``) to draw dummy weights exactly as a single
    device does, and the course builds each rank's share in one process to look at it. Nothing inside may run a
    collective (there is no group).

    Raises:
        ValueError: for a rank outside ``[0, world_size)``.
    """
    global _TP_RANK, _TP_SIZE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    saved = _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE = saved


def full_model_view():
    """``build_as_rank(0, 1)``: build the whole, unsharded model."""
    return build_as_rank(0, 1)


def torchrun_env() -> Optional[tuple]:
    """``(world_size, rank, local_rank)`` when this process was started by ``torchrun``, else ``None``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return (int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)))
    return None
