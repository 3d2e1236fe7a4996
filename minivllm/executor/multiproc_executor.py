"""Tensor parallelism with one worker process per rank, started by the engine (vLLM:
``vllm/v1/executor/multiproc_executor.py``, ``MultiprocExecutor`` and ``WorkerProc``).

The engine process keeps the scheduler and the KV cache manager (one of each, as with one device) and starts N
worker processes with ``torch.multiprocessing`` (``spawn``). Each worker process runs a ``Worker`` and answers the
executor's calls (``Executor``: load, measure memory, allocate the KV cache, then ``execute_model`` and
``sample_tokens`` each step). The workers form a ``torch.distributed`` group
(gloo on the CPU, NCCL on CUDA) through a TCP rendezvous on this machine; every tensor they exchange goes
through it. Each step the executor pickles the ``SchedulerOutput`` once and sends it to every worker over its
pipe; every rank runs the step, and rank 0 replies (to ``sample_tokens``: the ``ModelRunnerOutput``; the ranks'
outputs are the same).

Where minivllm differs from vLLM: vLLM broadcasts the scheduler output through a shared-memory ring buffer
(``MessageQueue``) and collects replies on ZMQ sockets; minivllm uses one ``multiprocessing`` pipe per worker
(only Python objects travel on it, never tensors).

Why ``spawn``: vLLM 0.32 starts its workers with ``fork`` by default (``VLLM_WORKER_MULTIPROC_METHOD``) and
switches to ``spawn`` when CUDA is already initialised (``_maybe_force_spawn``), since a forked child cannot use
the parent's CUDA context. minivllm must always spawn: PyTorch's CPU wheels use GNU OpenMP, and a child forked
after its parent ran one parallel region hangs at its own first one (measured here: a forked child's first
matmul never returned). A spawned worker imports the script that built the engine again, as vLLM's spawned
workers do, so that script must start the engine under ``if __name__ == "__main__":``; without the guard the
worker stops at once and the executor raises with that explanation (vLLM's troubleshooting page, "Python
multiprocessing", says the same).

Failures: while it waits, the executor watches every worker's pipe and process handle. A worker that raises
sends its traceback and exits; a worker that dies closes its pipe. Either way the executor kills every worker
(the others may be stuck in a collective waiting for the failed one), joins them, and raises ``RuntimeError``
naming the rank and the cause; the executor refuses work afterwards. Workers exit on their own when the engine
process goes away (their pipe reports end of file), and they are daemon processes, killed at the engine
process's exit, so none is left orphaned.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import shutil
import socket
import tempfile
import sys
import time
import traceback
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.multiprocessing as torch_mp

from minivllm import envs
from minivllm.config import VllmConfig
from minivllm.core.sched.output import SchedulerOutput
from minivllm.executor.abstract import Executor
from minivllm.outputs import ModelRunnerOutput
from minivllm.worker.worker import Worker

# Seconds a worker may take to start (spawn, import torch, join the group, load its share) and to run one step
# (vLLM: VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, default 300). A step past it counts as a hang: every worker is killed.
STARTUP_TIMEOUT_S = 300.0
EXECUTE_MODEL_TIMEOUT_S = 300.0

UNGUARDED_MAIN = (
    "the script that started the engine was run again in a worker process: tensor_parallel_size > 1 starts its "
    "workers with 'spawn', which imports the main script again, and this script builds the engine at import "
    "time. Put the code that builds the engine under\n\n    if __name__ == \"__main__\":\n\n(vLLM's "
    "troubleshooting page, 'Python multiprocessing', asks the same of scripts whose workers vLLM spawns)")


def _spawned_child_importing_main() -> bool:
    """True in a spawned child while it re-imports the parent's main script (multiprocessing sets
    ``_inheriting`` on the process object for exactly that phase, ``multiprocessing/spawn.py``)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def get_open_port() -> int:
    """A free TCP port on this machine for the rendezvous (vLLM: ``vllm.utils.get_open_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProc:
    """The loop of one worker process: receive a call, run it on the ``Worker``, reply if asked."""

    @staticmethod
    def worker_main(vllm_config: VllmConfig, rank: int, distributed_init_method: str,
                    conn: multiprocessing.connection.Connection) -> None:
        """Entry point of a spawned worker: init the device and load the model, then answer calls. Messages from
        the engine are ``(method, args, reply)``; ``method`` is a ``Worker`` method name, ``"shutdown"``, or a
        function called as ``method(worker, *args)`` (``collective_rpc``). Replies are ``("ready", pid)``,
        ``("output", result)`` or ``("error", text)``."""
        n = vllm_config.parallel_config.tensor_parallel_size
        if torch.device(vllm_config.device).type == "cpu":
            # N ranks share this machine's cores: OMP_NUM_THREADS if set, else an equal share each.
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // n))
        worker = Worker(vllm_config, rank, rank, distributed_init_method)
        try:
            worker.init_device()
            worker.load_model()
            conn.send(("ready", os.getpid()))
            while True:
                try:
                    method, args, reply = pickle.loads(conn.recv_bytes())
                except EOFError:
                    break  # the engine process is gone
                if method == "shutdown":
                    break
                fn = getattr(worker, method) if isinstance(method, str) else (lambda *a: method(worker, *a))
                result = fn(*args)
                if reply:
                    conn.send(("output", result))
            worker.shutdown()
            exit_code = 0
        except BaseException:  # noqa: BLE001 -- any failure is reported to the engine, which stops every rank
            exit_code = 1
            try:
                conn.send(("error", f"rank {rank} (pid {os.getpid()}):\n{traceback.format_exc()}"))
            except (OSError, EOFError):
                pass
        # Leave at once: here a normal interpreter exit did not finish within the executor's 5 s wait (gloo's and
        # OpenMP's threads), and the engine had to terminate every worker.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


_ERROR_FILE_ENV = "MINIVLLM_WORKER_ERROR_FILE"  # registered in minivllm.envs


def _report_unguarded_main() -> None:
    path = envs.MINIVLLM_WORKER_ERROR_FILE
    if path:
        try:
            with open(path, "w") as f:
                f.write(UNGUARDED_MAIN)
        except OSError:
            pass


def _kill_workers(procs: List[Any], graceful: bool) -> None:
    """Join the worker processes; terminate, then kill, any still alive after a short wait."""
    if graceful:
        deadline = time.monotonic() + 5.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


class MultiprocExecutor(Executor):
    """Runs each step on ``tensor_parallel_size`` worker processes (see the module docstring).

    Args:
        vllm_config: the engine's config (``parallel_config.tensor_parallel_size`` ranks), sent to every worker
            as it is.

    Raises:
        RuntimeError: a worker failed to start (its traceback included, or why a script needs its
            ``__main__`` guard); nothing is left running.
    """

    def _init_executor(self) -> None:
        vllm_config = self.vllm_config
        if self.model is not None or self.kv_connector is not None:
            # EngineArgs refuses both with tensor_parallel_size > 1; objects do not travel to worker processes.
            raise ValueError("MultiprocExecutor takes no built model and no KV connector: each worker loads its share")
        if _spawned_child_importing_main():
            # Starting workers from here would recurse; multiprocessing would raise its own, vaguer error.
            _report_unguarded_main()
            raise RuntimeError(f"tensor parallelism: {UNGUARDED_MAIN}")
        self.world_size = vllm_config.parallel_config.tensor_parallel_size
        self.is_failed = False
        self._failure: Optional[str] = None
        ctx = torch_mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        self._error_dir = tempfile.mkdtemp(prefix="minivllm-tp-")
        self.procs: List[Any] = []
        self.conns: List[multiprocessing.connection.Connection] = []
        # Whatever happens to this object (garbage collection, interpreter exit), no worker outlives it.
        self._finalizer = weakref.finalize(self, _kill_workers, self.procs, False)
        try:
            for rank in range(self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=WorkerProc.worker_main, name=f"minivllm-TP-worker-{rank}", daemon=True,
                                   args=(vllm_config, rank, init_method, child_conn))
                # A worker that dies while it re-imports the main script cannot use its pipe yet: it leaves its
                # reason in this file, which the child inherits through the environment.
                os.environ[_ERROR_FILE_ENV] = os.path.join(self._error_dir, f"rank{rank}")
                try:
                    proc.start()
                finally:
                    os.environ.pop(_ERROR_FILE_ENV, None)
                child_conn.close()  # the engine keeps only its end: the pipe closes when the worker dies
                self.procs.append(proc)
                self.conns.append(parent_conn)
            self.worker_pids = self._wait_for(range(self.world_size), STARTUP_TIMEOUT_S, "start")
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> List[int]:
        """The worker processes' ids, by rank."""
        return [p.pid for p in self.procs]

    def collective_rpc(self, method: Union[str, Callable], args: Sequence[Any] = (),
                       unique_reply_rank: Optional[int] = None, ranks: Optional[Sequence[int]] = None,
                       timeout: float = EXECUTE_MODEL_TIMEOUT_S) -> Any:
        """Run ``method`` on the workers of ``ranks`` (default: all): a ``Worker`` method name, or a module-level
        function called as ``method(worker, *args)``. Returns the reply of ``unique_reply_rank``, or the list of
        every called rank's reply when it is ``None`` (vLLM's ``collective_rpc``).

        Raises:
            RuntimeError: when a worker raises, dies or exceeds ``timeout`` seconds; every worker is then stopped.
        """
        if self.is_failed:
            raise RuntimeError(f"the tensor-parallel workers were stopped after a failure: {self._failure}")
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        reply_ranks = ranks if unique_reply_rank is None else [unique_reply_rank]
        for rank in ranks:
            msg = pickle.dumps((method, tuple(args), rank in reply_ranks))
            try:
                self.conns[rank].send_bytes(msg)
            except (OSError, ValueError):
                pass  # the worker is gone: _wait_for reports it
        results = self._wait_for(reply_ranks, timeout, method if isinstance(method, str) else method.__name__)
        return results[unique_reply_rank] if unique_reply_rank is not None else [results[r] for r in reply_ranks]

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """Send the step to every rank (pickled once); rank 0's reply comes back (``None``, or an empty step's
        output)."""
        return self._call_all("execute_model", scheduler_output)

    def sample_tokens(self, grammar_output: None = None) -> ModelRunnerOutput:
        """Every rank samples the step; rank 0's ``ModelRunnerOutput`` comes back."""
        return self._call_all("sample_tokens", grammar_output)

    def _call_all(self, method: str, arg: Any) -> Any:
        """``method(arg)`` on every rank, the message pickled once per reply kind; rank 0 replies."""
        if self.is_failed:
            raise RuntimeError(f"the tensor-parallel workers were stopped after a failure: {self._failure}")
        msg = pickle.dumps((method, (arg,), False))
        reply = pickle.dumps((method, (arg,), True))
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(reply if rank == 0 else msg)
            except (OSError, ValueError):
                pass
        return self._wait_for([0], EXECUTE_MODEL_TIMEOUT_S, method)[0]

    def _wait_for(self, ranks: Sequence[int], timeout: float, what: str) -> Dict[int, Any]:
        """Each of ``ranks``' next reply, while watching *every* worker for an error or an exit."""
        pending, results = set(ranks), {}
        deadline = time.monotonic() + timeout
        conn_rank = {id(c): r for r, c in enumerate(self.conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            remaining = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(self.conns + list(sentinel_rank), timeout=max(remaining, 0))
            if not ready:
                self._fail(f"no reply to {what} from rank(s) {sorted(pending)} within {timeout:.0f} s")
            # Messages first: a worker that raised has sent its traceback before exiting.
            for obj in sorted(ready, key=lambda o: not isinstance(o, multiprocessing.connection.Connection)):
                if isinstance(obj, multiprocessing.connection.Connection):
                    rank = conn_rank[id(obj)]
                    try:
                        kind, payload = obj.recv()
                    except (EOFError, OSError):
                        self._fail(self._exit_message(rank, what))
                    if kind == "error":
                        self._fail(f"worker failed during {what}: {payload}")
                    results[rank] = payload
                    pending.discard(rank)
                else:
                    rank = sentinel_rank[obj]
                    conn = self.conns[rank]
                    if conn.poll():
                        continue  # read its last message on the next pass
                    self._fail(self._exit_message(rank, what))
        return results

    def _exit_message(self, rank: int, what: str) -> str:
        """Why a worker exited without a reply: its own report when it left one, else its exit code."""
        message = f"rank {rank} (pid {self.procs[rank].pid}) exited during {what} (exit code {self._exitcode(rank)})"
        try:
            with open(os.path.join(self._error_dir, f"rank{rank}")) as f:
                return f"{message}: {f.read()}"
        except OSError:
            return message

    def _exitcode(self, rank: int) -> Optional[int]:
        self.procs[rank].join(1.0)
        return self.procs[rank].exitcode

    def _fail(self, message: str) -> None:
        self.is_failed, self._failure = True, message.splitlines()[0]
        self._stop(graceful=False)
        raise RuntimeError(f"tensor parallelism: {message}\nall {self.world_size} worker processes were stopped")

    def _stop(self, graceful: bool) -> None:
        if graceful:
            msg = pickle.dumps(("shutdown", (), False))
            for conn in self.conns:
                try:
                    conn.send_bytes(msg)
                except (OSError, ValueError):
                    pass
        _kill_workers(self.procs, graceful)
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        shutil.rmtree(getattr(self, "_error_dir", ""), ignore_errors=True)

    def shutdown(self) -> None:
        """Stop every worker (asked first, then terminated, then killed) and wait for them; idempotent."""
        if not self.is_failed:
            self.is_failed, self._failure = True, "the executor was shut down"
        if self.conns or any(p.is_alive() for p in self.procs):
            self._stop(graceful=True)
